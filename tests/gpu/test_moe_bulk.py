"""GPU tests of the bulk-copy MoE GEMMs (cuda_src/moe_bulk.cu, ``moe_forward(..., bulk=True)``) against the
float64 numpy reference, with the layers, routing and poisoning of test_moe.py: every width (I = 32 pads K to
one k64 step, 256 gives the down GEMM one 4-step stage per unit, 2048 eight), T = 1 .. 32 (T*k <= 256),
experts with several chunks, duplicate and bad ids, graph replay, and a PDL chain in which the down kernel's
pre-wait reads (ids and routing weights written two kernels earlier) would see stale values if the reasoning
in the kernel's header were wrong."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.kernels import moe

from test_moe import TOL, _out_and_y, _routing, _run
from test_moe import narrow, tiny, tiny256, wide  # noqa: F401  (the same layer fixtures)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layer_name,T,mode", [
    ("tiny", 1, "uniform"), ("tiny", 13, "uniform"), ("tiny256", 5, "uniform"), ("tiny256", 32, "one_expert"),
    ("narrow", 1, "uniform"), ("narrow", 8, "uniform"), ("narrow", 20, "one_expert"), ("narrow", 32, "uniform"),
    ("wide", 1, "uniform"), ("wide", 9, "uniform"), ("wide", 24, "one_expert")])
def test_bulk_matches_reference(layer_name, T, mode, request):
    layer = request.getfixturevalue(layer_name)
    assert _run(layer, T, 8, seed=3000 + T, mode=mode, bulk=True) < TOL


@pytest.mark.parametrize("T", [3, 32])
def test_bulk_residual_and_duplicate_ids(tiny256, T):
    assert _run(tiny256, T, 8, seed=3100 + T, mode="duplicates", residual=True, bulk=True) < TOL


def test_bulk_is_deterministic_and_agrees_with_the_ring(narrow):
    # fixed summation order: two calls are bit-identical; the register-ring path (another K split) agrees
    # within bf16 tolerance
    T = 16
    o0, y0, x, ids, wts = _out_and_y(narrow, T, 8, 3200, bulk=True)
    o1, y1, *_ = _out_and_y(narrow, T, 8, 3200, bulk=True)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(o1, o0)
    o2, *_ = _out_and_y(narrow, T, 8, 3200, bulk=False)
    a, b = (bf16_bits_to_f32(o).astype(np.float64) for o in (o0, o2))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < TOL


def test_bulk_publishes_the_sort(narrow):
    import cupy as cp
    T = 20
    rng = np.random.default_rng(3300)
    ids, wts = _routing(rng, T, narrow.E, 8, "one_expert")
    x = to_bf16_bits(rng.standard_normal((T, narrow.H)))
    ws = moe.MoEWorkspace(T, 8, narrow.w)
    ws.chunks.fill(-7)
    ws.slot_pair.fill(-7)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), narrow.w, ws, bulk=True)
    chunks, slot_pair, bad = moe.fused_sort_numpy(ids, narrow.E, 8)
    assert int(ws.meta[0].get()) == len(chunks) and ws.bad_ids() == bad == 0
    np.testing.assert_array_equal(ws.chunks[:len(chunks), :3].get(), chunks[:, :3])
    np.testing.assert_array_equal(ws.slot_pair[:len(slot_pair)].get(), slot_pair)


def test_bulk_under_pdl_matches_plain(narrow):
    # ROUNDS x (mixing GEMM -> router -> bulk MoE): the router writes new ids / weights every round, and the
    # down kernel reads them before its PDL wait. With PDL on (eager and graph-replayed) the outputs must be
    # bit-identical to plain launches.
    import cupy as cp
    from ddtree_cupy.kernels import gemm, launch, router
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("PDL needs sm_90+")
    layer = narrow
    rng = np.random.default_rng(3600)
    T, k, R = 16, 8, 4
    xs = cp.asarray(to_bf16_bits(rng.standard_normal((R, T, layer.H))))
    w_mix = cp.asarray(to_bf16_bits(rng.standard_normal((layer.H, layer.H)) * 0.02))
    gate = cp.asarray(to_bf16_bits(rng.standard_normal((layer.E, layer.H)) * 0.05))
    bias = cp.zeros(layer.E, dtype=cp.float32)
    ws = moe.MoEWorkspace(T, k, layer.w)
    xm = cp.empty((T, layer.H), cp.uint16)
    ids = cp.empty((T, k), cp.int32)
    wts = cp.empty((T, k), cp.float32)
    logits = cp.empty((T, layer.E), cp.float32)
    gws = cp.empty(1 << 22, cp.float32)

    def chain(outs):
        for r in range(R):
            gemm.gemm_bf16(xs[r], w_mix, xm, workspace=gws)
            router.route(xm, gate, bias, k, out_ids=ids, out_weights=wts, logits=logits)
            moe.moe_forward(xm, ids, wts, layer.w, ws, out=outs[r], bulk=True)

    def fresh():     # poisoned outputs, finished before the non-blocking stream uses them
        out = cp.full((R, T, layer.H), 0xFFFF, cp.uint16)
        cp.cuda.Stream.null.synchronize()
        return out

    s = cp.cuda.Stream(non_blocking=True)
    try:
        launch.set_pdl(False)
        ref = fresh()
        with s:
            chain(ref)
            s.synchronize()
        ref = ref.get()
        assert np.all(ref != 0xFFFF)
        launch.set_pdl(True)
        got = fresh()
        with s:
            chain(got)
            s.synchronize()
        np.testing.assert_array_equal(got.get(), ref, err_msg="PDL eager")
        got = fresh()
        with s:
            s.begin_capture()
            chain(got)
            graph = s.end_capture()
            for _ in range(2):
                got.fill(0xFFFF)
                graph.launch(s)
                s.synchronize()
                np.testing.assert_array_equal(got.get(), ref, err_msg="PDL graph replay")
    finally:
        launch.set_pdl(False)


def test_bulk_argument_errors(tiny256):
    import cupy as cp
    layer = tiny256
    T = 40                                   # T*k = 320 > FUSED_MAX_PAIRS
    ws = moe.MoEWorkspace(T, 8, layer.w)
    x = cp.zeros((T, layer.H), cp.uint16)
    ids = cp.zeros((T, 8), cp.int32)
    wts = cp.zeros((T, 8), cp.float32)
    with pytest.raises(ValueError, match="bulk"):
        moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True)
    with pytest.raises(ValueError, match="bulk"):
        moe.moe_forward(x[:4], ids[:4], wts[:4], layer.w, ws, bulk=True, fuse_route=False)


@pytest.mark.parametrize("layer_name,T", [("tiny", 13), ("narrow", 8)])
def test_every_compiled_bulk_block(layer_name, T, request):
    # the benchmark's alternatives (other stage depths / splits / the polling wait) are right too
    layer = request.getfixturevalue(layer_name)
    for gu in (moe.BULK_GATEUP,) + moe.BULK_GATEUP_CANDIDATES:
        assert _run(layer, T, 8, seed=3700 + T, bulk=True, bulk_tiles=(gu, moe.BULK_DOWN)) < TOL, gu
    for dn in moe.BULK_DOWN_CANDIDATES:
        assert _run(layer, T, 8, seed=3800 + T, bulk=True, bulk_tiles=(moe.BULK_GATEUP, dn)) < TOL, dn


@pytest.mark.parametrize("layer_name,T,mode", [("narrow", 1, "uniform"), ("narrow", 20, "one_expert"),
                                               ("wide", 9, "uniform"), ("tiny", 32, "duplicates")])
def test_ring_gateup_with_bulk_down(layer_name, T, mode, request):
    # bulk="down": the register-ring gate/up publishes nothing the bulk down reads but h; the down re-derives
    # the same slots from its own sort
    layer = request.getfixturevalue(layer_name)
    assert _run(layer, T, 8, seed=3900 + T, mode=mode, bulk="down", residual=True) < TOL


@pytest.mark.parametrize("layer_name,T", [("narrow", 8), ("tiny256", 29)])
def test_down_whole_k_stage_is_bit_identical_to_per_tile_copies(layer_name, T, request, monkeypatch):
    # I = 256: the down stage holds the whole K, copied as three runs (tiles, scales, h rows, unpadded) or,
    # with BULK_WHOLE off, one copy per tile and token row: same data, same arithmetic, same bits
    layer = request.getfixturevalue(layer_name)
    o1, y1, *_ = _out_and_y(layer, T, 8, 4000 + T, bulk=True)
    monkeypatch.setattr(moe, "BULK_WHOLE", False)
    o0, y0, *_ = _out_and_y(layer, T, 8, 4000 + T, bulk=True)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(o1, o0)
