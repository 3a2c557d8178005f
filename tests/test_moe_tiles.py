"""CPU tests of the MoE tile table's down-GEMM rows-per-warp setting (ddtree_cupy/kernels/moe.py): the model
of the device's choice (choose_rpw_numpy, which the GPU test compares with what the kernel picked) and the
argument checks of Tile."""
from __future__ import annotations

import itertools

import pytest

from ddtree_cupy.kernels import moe


def _cost(n_chunks, npairs, wm, nsteps, grid, r):
    # written independently of the model: units of wm*r tile pairs, waves of `grid` blocks
    groups = (npairs + wm * r - 1) // (wm * r)
    waves = (n_chunks * groups + grid - 1) // grid
    return waves * (r * nsteps + moe.RPW_OVERHEAD)


def test_choose_rpw_is_the_cheapest_distinct_split():
    for n_chunks, npairs, wm, nsteps, grid in itertools.product((1, 8, 56, 105, 285, 650), (16, 224, 64),
                                                                (8, 2), (1, 4, 8), (1, 100, 264)):
        r = moe.choose_rpw_numpy(n_chunks, npairs, wm, nsteps, grid)
        assert 1 <= r <= moe.RPW_MAX
        costs = [_cost(n_chunks, npairs, wm, nsteps, grid, q) for q in range(1, moe.RPW_MAX + 1)]
        assert costs[r - 1] == min(costs)
        # the smallest R of its split (a larger R with the same number of m-groups only idles warps)
        if r > 1:
            assert -(-npairs // (wm * r)) != -(-npairs // (wm * (r - 1)))


def test_choose_rpw_known_points():
    # H = 7168 (224 tile pairs), 8-warp down blocks, I = 256 (4 k64 steps), 264 block slots (H200)
    assert moe.choose_rpw_numpy(8, 224, 8, 4, 224) == 1        # T = 1: one wave of R = 1 units already
    assert moe.choose_rpw_numpy(58, 224, 8, 4, 264) == 7       # T = 8: 4 m-groups x 58 chunks = one wave
    assert moe.choose_rpw_numpy(108, 224, 8, 4, 264) == 4      # T = 16
    assert moe.choose_rpw_numpy(285, 224, 8, 4, 264) == 4      # T = 64


def test_tile_rpw_arguments():
    assert moe.select_tiles("sm_90", 8, 256).down.rpw == 0
    assert moe.select_tiles("sm_120", 8, 256).down.rpw == 0
    assert moe.select_tiles("sm_90", 1, 256).down.stages == 8       # T = 1: the cp.async ring, rpw = 1
    assert moe.select_tiles("sm_90", 1, 256).down.rpw == 1
    assert moe.select_tiles("sm_90", 8, 2048).down.rpw == 1    # 2 x 4 blocks split K: no flat stream
    with pytest.raises(ValueError, match="rpw"):
        moe.Tile(2, 4, 3, rpw=2)
    with pytest.raises(ValueError, match="rpw"):
        moe.Tile(8, 1, 3, stages=8, rpw=0)
    with pytest.raises(ValueError, match="rpw"):
        moe.Tile(8, 1, 3, rpw=moe.RPW_MAX + 1)
    t = moe.select_tiles("sm_90", 8, 256)
    assert moe.with_stages(t, 8).down.rpw == 1 and moe.with_stages(moe.with_stages(t, 8), 0).down.rpw == 1
    assert moe.with_down_rpw(t, 5).down == moe.Tile(8, 1, t.down.u, 0, 5)
