"""CPU tests of the GEMM kernel selection (kernels/gemm.py): which decode config ``choose_decode`` picks at
the engine's shapes on the H200 and on an sm_120-like device, that every pick is compiled and can serve
the call, and the forcing switches."""
import numpy as np
import pytest

from ddtree_cupy.kernels import gemm

H200 = dict(sm_count=132, smem_per_sm=228 * 1024)
SM120 = dict(sm_count=188, smem_per_sm=100 * 1024)
# (name, N, K, batch): one TP=8 rank's GEMMs (bench/kernels.py GEMMS)
ENGINE = [("q_a+kv_a", 2112, 7168, 1), ("q_b", 1536, 1536, 1), ("W_UK^T", 512, 128, 8), ("W_UV", 128, 512, 8),
          ("o_proj", 7168, 1024, 1), ("gate+up", 4608, 7168, 1), ("down", 7168, 2304, 1),
          ("shared gate+up", 512, 7168, 1), ("shared down", 7168, 256, 1), ("router", 384, 7168, 1),
          ("lm_head", 20480, 7168, 1), ("drafter qkv", 1280, 7168, 1)]


def _blocks(c, N, B):
    return N // c.rows() * c.cs * B


@pytest.mark.parametrize("dev", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize("T", [1, 8, 9, 16])
@pytest.mark.parametrize("name,N,K,B", ENGINE, ids=[e[0] for e in ENGINE])
def test_pick_is_compiled_and_serves(dev, T, name, N, K, B):
    c = gemm.choose_decode(T, N, K, B, **dev)
    assert c in gemm.DEC_CONFIGS
    assert c.nt * 8 >= T and (c.nt == 1) == (T <= 8)     # the smallest token tile that holds T
    assert N % c.rows() == 0
    assert c.smem() <= 99 * 1024                          # sm_120's per-block limit
    slots = dev["sm_count"] * max(1, dev["smem_per_sm"] // (c.smem() + 1024))
    base = gemm.DecodeConfig(c.nt, gemm.dec_stages(c.nt), 1, 1)
    # a pick other than the base always fits one wave of resident blocks
    assert c == base or _blocks(c, N, B) <= slots


def test_h200_picks():
    """The H200 table written before the run (docs/KERNELS.md "Decode family"): what each miss gets."""
    pick = lambda T, N, K, B=1: tuple(gemm.choose_decode(T, N, K, B, **H200))[2:]  # noqa: E731  (rt, cs)
    assert pick(1, 2112, 7168) == (1, 2)          # q_a+kv_a: 264 blocks, 2 per SM
    assert pick(16, 2112, 7168) == (1, 2)
    assert pick(1, 7168, 1024) == (2, 1)          # o_proj: 4 k tiles per warp, 224 blocks
    assert pick(1, 7168, 2304) == (2, 1)          # down: 224 blocks in one wave
    assert pick(1, 1280, 7168) == (1, 2)          # drafter qkv: 160 blocks
    assert pick(16, 4608, 7168) == (2, 1)         # gate+up T > 8: 144 blocks
    assert gemm.choose_decode(1, 4608, 7168, 1, **H200) == gemm.DecodeConfig(1, 3, 1, 1)  # light ring: 288 in 396
    assert pick(1, 20480, 7168) == (1, 1)         # lm_head: many waves anyway, small blocks balance best
    assert pick(16, 384, 7168) == (1, 4)          # router: 96 blocks
    assert pick(1, 1536, 1536) == (1, 1)          # q_b: already 96 blocks with 3 tiles per warp


def test_sm120_single_slot():
    """One 96 KB block per SM on sm_120: the pick never needs two per SM."""
    for T in (1, 16):
        for _, N, K, B in ENGINE:
            c = gemm.choose_decode(T, N, K, B, **SM120)
            if c != gemm.DecodeConfig(c.nt, gemm.dec_stages(c.nt), 1, 1):
                assert _blocks(c, N, B) <= 188


def test_configs_fit_and_unique():
    assert len(set(gemm.DEC_CONFIGS)) == len(gemm.DEC_CONFIGS)
    for c in gemm.DEC_CONFIGS:
        assert c.smem() <= 96 * 1024 and c.stages >= 3
        assert gemm.DEC_WARPS % c.rt == 0 and (c.cs == 1 or c.rt == 1)
        assert c.name(False) != c.name(True)
    names = set(gemm.SPEC.names)
    assert all(c.name(f) in names for c in gemm.DEC_CONFIGS for f in (False, True))


def test_switches():
    old = gemm.set_variant("splitk")
    try:
        assert not gemm.use_decode(1, 2112, 7168)
        gemm.set_variant("decode")
        assert gemm.use_decode(16, 2112, 7168) and not gemm.use_decode(17, 2112, 7168)
    finally:
        gemm.set_variant(old)
    with pytest.raises(ValueError, match="variant"):
        gemm.set_variant("fast")
    with pytest.raises(ValueError, match="cfg"):
        gemm.set_decode_config(gemm.DecodeConfig(1, 5, 1, 1))
    assert gemm.set_decode_config(gemm.DEC_CONFIGS[0]) is None
    assert gemm.set_decode_config(None) == gemm.DEC_CONFIGS[0]
