"""GPU tests of the bulk-copy MoE GEMMs (cuda_src/moe_bulk.cu, ``moe_forward(..., bulk=True)``) against the
float64 numpy reference, with the layers, routing and poisoning of test_moe.py: every width (I = 32 pads K to
one k64 step, 256 gives the down GEMM one 4-step stage per unit, 2048 eight), T = 1 .. 32 (T*k <= 256),
experts with several chunks, duplicate and bad ids, graph replay, and a PDL chain in which the down kernel's
pre-wait reads (ids and routing weights written two kernels earlier) would see stale values if the reasoning
in the kernel's header were wrong.

Above 256 pairs: the same kernels fed by moe_route's global chunk list (template G = 1; T*k > 256, or fuse_route=False
at any T): T = 33 .. 320 with E = 384 and small E, one expert holding every token, bad ids, I = 32 / 256 / 2048,
bit-identity with the shared-memory sort (G = 0: only the slot order differs, every output column's arithmetic
is the same), every compiled large-T block, graph replay, a workspace reused from a larger T, and the PDL chain
(the down kernel reads moe_route's chunk list before its wait).

Compact token rows: the gate/up blocks with stages of xr = 4 / 2 token rows (chunks of xr tokens, a
third stage) against the float64 reference at T = 4 .. 32 and bit for bit against the table's block (h, y, out),
experts with many chunks, every pair on one expert, bad ids, graph replay, the published sort, the environment
override and the PDL chain."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.kernels import moe

from test_moe import (TOL, Layer, _assert_bad_ids_skipped, _assert_publishes_the_sort, _bad_id_inputs, _out_and_y,
                      _replay_with_new_routing, _routing, _run)
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
    T = 20
    rng = np.random.default_rng(3300)
    ids, wts = _routing(rng, T, narrow.E, 8, "one_expert")
    x = to_bf16_bits(rng.standard_normal((T, narrow.H)))
    # block 0 of the gate/up publishes its sort: chunks of the table block's token rows (4 at I <= 512)
    chunk = moe._bulk_tiles_for(False, narrow.w.inter)[0].xr
    assert chunk == moe.BULK_GATEUP_COMPACT.xr
    _assert_publishes_the_sort(narrow, x, ids, wts, chunk, bulk=True)


COMPACT = tuple(bt for bt in moe.BULK_GATEUP_CANDIDATES if bt.xr != 8)     # xr = 4, 2


@pytest.mark.parametrize("T,gu", [(16, None), (40, None), (16, COMPACT[0]), (8, COMPACT[-1])])
def test_bulk_under_pdl_matches_plain(narrow, T, gu):
    # ROUNDS x (mixing GEMM -> router -> bulk MoE): the router writes new ids / weights every round, and the
    # down kernel reads them before its PDL wait (T = 40: also moe_route's chunk list, written two kernels
    # earlier, G = 1). With PDL on (eager and graph-replayed) the outputs must be bit-identical to plain
    # launches (G = 1: moe_route's atomic slot order may differ between runs, each output's arithmetic not).
    import cupy as cp
    from ddtree_cupy.kernels import gemm, launch, router
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("PDL needs sm_90+")
    layer = narrow
    rng = np.random.default_rng(3600 + T)
    k, R = 8, 4
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
            moe.moe_forward(xm, ids, wts, layer.w, ws, out=outs[r], bulk=True,
                            bulk_tiles=None if gu is None else (gu, moe.BULK_DOWN))

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
    with pytest.raises(ValueError, match="bulk"):              # the register ring runs at T*k <= 256 only
        moe.moe_forward(x, ids, wts, layer.w, ws, bulk=False)
    with pytest.raises(ValueError, match="fuse_route"):        # 320 pairs cannot be sorted in shared memory
        moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True, fuse_route=True)
    with pytest.raises(ValueError, match="tiles"):
        moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True, tiles=moe.select_tiles("sm_90", T, layer.I))
    with pytest.raises(ValueError, match="l2_prefetch"):       # no routing kernel to prefetch with
        moe.moe_forward(x[:4], ids[:4], wts[:4], layer.w, ws, bulk=True, l2_prefetch=True)
    with pytest.raises(ValueError, match="bulk_tiles"):        # a decode-only block at large T
        moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True,
                        bulk_tiles=(moe.BULK_GATEUP_CANDIDATES[1], moe.BULK_DOWN_LARGE))


@pytest.mark.parametrize("layer_name,T", [("tiny", 13), ("narrow", 8)])
def test_every_compiled_bulk_block(layer_name, T, request):
    # the benchmark's alternatives (other stage depths / splits / the polling wait) are right too
    _each_block_is_right(request.getfixturevalue(layer_name), T, 3700 + T, (moe.BULK_GATEUP,) + moe.BULK_GATEUP_CANDIDATES,
                         (moe.BULK_DOWN,) + moe.BULK_DOWN_CANDIDATES)


def _each_block_is_right(layer, T, seed, gate_ups, downs):
    """Every gate/up block with the first down block (inputs of ``seed``), then every other down block with the first
    gate/up block (``seed`` + 100), against the float64 reference."""
    for gu in gate_ups:
        assert _run(layer, T, 8, seed=seed, bulk=True, bulk_tiles=(gu, downs[0])) < TOL, gu
    for dn in downs[1:]:
        assert _run(layer, T, 8, seed=seed + 100, bulk=True, bulk_tiles=(gate_ups[0], dn)) < TOL, dn


@pytest.mark.parametrize("layer_name,T", [("narrow", 8), ("tiny256", 29)])
def test_down_whole_k_stage_is_bit_identical_to_per_tile_copies(layer_name, T, request, monkeypatch):
    # I = 256: the down stage holds the whole K, copied as three runs (tiles, scales, h rows, unpadded) or,
    # with BULK_WHOLE off, one copy per tile and token row: same data, same arithmetic, same bits
    layer = request.getfixturevalue(layer_name)
    o1, y1, *_ = _out_and_y(layer, T, 8, 4000 + T, bulk=True)
    monkeypatch.setattr(moe.forward, "BULK_WHOLE", False)
    o0, y0, *_ = _out_and_y(layer, T, 8, 4000 + T, bulk=True)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(o1, o0)


# ---------------------------------------------------------------------------------------------------------
# Large T (moe_route's global chunk list, G = 1)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def e384():      # Kimi's expert count with a short hidden size (the reference dequantises all 384 experts)
    return Layer(11, E=384, H=512, I=256)


@pytest.fixture(scope="module")
def wide2k():    # I = 2048 (the down GEMM's K is 32 steps: 8 stages per unit) with a short hidden size
    return Layer(12, E=32, H=512, I=2048)


def _kernel_names(monkeypatch):
    """Record the kernel names moe.py asks for (which GEMM family and routing source actually ran)."""
    seen = []
    orig = moe.forward.get_kernel

    def spy(spec, name, **kw):
        seen.append(name)
        return orig(spec, name, **kw)
    monkeypatch.setattr(moe.forward, "get_kernel", spy)
    return seen


@pytest.mark.parametrize("layer_name,T,mode,residual", [
    ("e384", 33, "uniform", False), ("e384", 64, "uniform", True), ("e384", 80, "one_expert", False),
    ("e384", 160, "uniform", False), ("e384", 320, "uniform", True),
    ("tiny256", 64, "one_expert", False),      # E = 32: expert 3 holds 64 tokens = 8 chunks
    ("tiny", 40, "duplicates", True),          # I = 32 (K padded to one step), repeated ids in a token
    ("wide2k", 48, "uniform", False), ("wide2k", 100, "one_expert", True),
    ("narrow", 48, "uniform", False),          # H = 7168: full 16-step gate/up stages
    ("wide", 40, "uniform", False)])           # H = 7168, I = 2048
def test_bulk_large_t_matches_reference(layer_name, T, mode, residual, request, monkeypatch):
    layer = request.getfixturevalue(layer_name)
    names = _kernel_names(monkeypatch)
    assert _run(layer, T, 8, seed=5000 + T, mode=mode, residual=residual, bulk=True) < TOL
    assert "moe_route" in names
    assert moe._bulk_name(0, moe.BULK_GATEUP_LARGE, 1) in names and moe._bulk_name(1, moe.BULK_DOWN_LARGE, 1) in names


@pytest.mark.parametrize("layer_name,T,mode", [("narrow", 16, "uniform"), ("tiny256", 32, "one_expert"),
                                               ("wide2k", 9, "duplicates")])
def test_global_routing_is_bit_identical_to_the_shared_memory_sort(layer_name, T, mode, request):
    # fuse_route=False at T*k <= 256: the same blocks fed by moe_route (other slots, chunks of the same <= 8
    # tokens per expert but perhaps grouped differently) -- every y row's arithmetic is the same, so y and out
    # match bit for bit
    layer = request.getfixturevalue(layer_name)
    bt = (moe.BULK_GATEUP, moe.BULK_DOWN)       # the decode table's blocks, compiled with both G
    o0, y0, x, ids, wts = _out_and_y(layer, T, 8, 5100 + T, mode, bulk=True, bulk_tiles=bt)
    o1, y1, *_ = _out_and_y(layer, T, 8, 5100 + T, mode, bulk=True, fuse_route=False, bulk_tiles=bt)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(o1, o0)
    ref = layer.reference(x, ids, wts)
    got = bf16_bits_to_f32(o1).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL


@pytest.mark.parametrize("layer_name,T", [("e384", 160), ("narrow", 64)])
def test_bulk_large_t_is_deterministic(layer_name, T, request):
    # moe_route's atomic ranks may order the slots differently between calls; y per pair is the same bits
    # (with and without the route's L2 prefetch)
    layer = request.getfixturevalue(layer_name)
    o0, y0, *_ = _out_and_y(layer, T, 8, 5200 + T, "one_expert", bulk=True)
    o1, y1, *_ = _out_and_y(layer, T, 8, 5200 + T, "one_expert", bulk=True, l2_prefetch=False)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(o1, o0)


@pytest.mark.parametrize("layer_name,T", [("e384", 80), ("wide2k", 40)])
def test_every_compiled_large_t_bulk_block(layer_name, T, request):
    _each_block_is_right(request.getfixturevalue(layer_name), T, 5300 + T,
                         (moe.BULK_GATEUP_LARGE,) + moe.BULK_GATEUP_LARGE_CANDIDATES,
                         (moe.BULK_DOWN_LARGE,) + moe.BULK_DOWN_LARGE_CANDIDATES)


def test_bulk_large_t_bad_ids_are_counted_and_skipped(e384):
    import cupy as cp
    layer = e384
    T, k = 50, 8
    x, res, ids, wts, n_bad, ref = _bad_id_inputs(layer, T, k, 5500, more=((7, 5),))
    ws = moe.MoEWorkspace(T, k, layer.w)
    ws.y.fill(np.nan)
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out,
                    residual=cp.asarray(res), bulk=True)
    assert ws.bad_ids() == n_bad == 2 + k
    _assert_bad_ids_skipped(out.get(), res, ref)


def test_bulk_large_t_graph_replay_and_reused_workspace(e384):
    # one workspace sized for T = 320: eager 320 tokens, then a captured 64-token call (the chunk count and the
    # slots come from this call's moe_route, not the larger call's leftovers), replayed with new routing
    import cupy as cp
    layer = e384
    rng = np.random.default_rng(5600)
    k = 8
    ws = moe.MoEWorkspace(320, k, layer.w)
    xb = to_bf16_bits(rng.standard_normal((320, layer.H)))
    ib, wb = _routing(rng, 320, layer.E, k)
    big = moe.moe_forward(cp.asarray(xb), cp.asarray(ib), cp.asarray(wb), layer.w, ws, bulk=True)
    ref = layer.reference(xb, ib, wb)
    assert np.linalg.norm(bf16_bits_to_f32(big.get()) - ref) / np.linalg.norm(ref) < TOL
    T = 64
    x = cp.asarray(to_bf16_bits(rng.standard_normal((T, layer.H))))
    ids, wts = (cp.asarray(a) for a in _routing(rng, T, layer.E, k, "one_expert"))
    eager = moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True)
    _replay_with_new_routing(layer, rng, x, ids, wts, ws, eager, "uniform", bulk=True)


def test_bulk_large_t_is_the_plain_call(e384, monkeypatch):
    # moe_forward with no options follows bulk_for: at T*k > 256 the G = 1 bulk kernels, never the ring
    names = _kernel_names(monkeypatch)
    assert _run(e384, 40, 8, seed=5700) < TOL
    assert moe._bulk_name(0, moe.BULK_GATEUP_LARGE, 1) in names
    assert not any(n.startswith("moe_gemm<") for n in names)


# ---------------------------------------------------------------------------------------------------------
# Compact token rows (docs/MOE.md "Compact token rows")
# ---------------------------------------------------------------------------------------------------------
def _compact_call(layer, x, ids, wts, gu, residual=None, ws=None):
    """One bulk call with gate/up block ``gu`` and poisoned h / y / out: (out, y bits, h bits, ws)."""
    import cupy as cp
    T, k = ids.shape
    ws = ws or moe.MoEWorkspace(T, k, layer.w)
    ws.y.fill(np.nan)
    ws.h[:, :layer.I] = 0xFFFF      # bf16 NaN (the padding columns [I, Ip) must stay zero: the down reads them)
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out,
                    residual=None if residual is None else cp.asarray(residual), bulk=True,
                    bulk_tiles=(gu, moe.BULK_DOWN))
    return out.get(), ws.y.get().view(np.uint32), ws.h.get(), ws


def _assert_compact_is_the_table(layer, x, ids, wts, residual=None):
    """Every compact block: within TOL of the float64 reference and bit-identical to the table's block (h of the
    valid slots, y of the valid pairs, out)."""
    o8, y8, h8, ws = _compact_call(layer, x, ids, wts, moe.BULK_GATEUP, residual)
    valid = ((ids >= 0) & (ids < layer.E)).reshape(-1)
    n_valid = int(valid.sum())
    assert not np.any(h8[:n_valid, :layer.I] == 0xFFFF) and np.all(o8 != 0xFFFF)
    ref = layer.reference(x, ids, wts, residual)
    for gu in COMPACT:
        o, y, h, _ = _compact_call(layer, x, ids, wts, gu, residual)
        np.testing.assert_array_equal(h[:n_valid], h8[:n_valid], err_msg=f"h {gu}")
        np.testing.assert_array_equal(y[valid], y8[valid], err_msg=f"y {gu}")
        np.testing.assert_array_equal(o, o8, err_msg=f"out {gu}")
        got = bf16_bits_to_f32(o).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL, gu
    return ws


@pytest.mark.parametrize("layer_name,T,mode", [
    ("narrow", 4, "uniform"), ("narrow", 8, "uniform"), ("narrow", 16, "uniform"), ("narrow", 32, "uniform"),
    ("narrow", 20, "one_expert"),      # expert 3 holds 20 tokens: 5 chunks of 4, 10 of 2
    ("tiny", 13, "duplicates"),        # I = 32 (K padded to one step), repeated ids inside a token
    ("tiny256", 32, "one_expert"),     # H = 512: 8-step stages (a partial stage of the 16-step ring)
    ("wide", 9, "uniform")])           # I = 2048: 64 m-groups per chunk
def test_compact_gateup_matches_reference_and_the_table_bit_for_bit(layer_name, T, mode, request):
    layer = request.getfixturevalue(layer_name)
    rng = np.random.default_rng(7000 + T)
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids, wts = _routing(rng, T, layer.E, 8, mode)
    res = to_bf16_bits(rng.standard_normal((T, layer.H))) if mode == "one_expert" else None
    _assert_compact_is_the_table(layer, x, ids, wts, res)


def test_compact_gateup_every_pair_on_one_expert(tiny256):
    # T*k = 256 pairs all on expert 3 (8 times in every token): 64 chunks of 4 / 128 of 2 for one expert, the
    # largest chunk list the shared-memory sort holds
    layer = tiny256
    rng = np.random.default_rng(7100)
    T = 32
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids = np.full((T, 8), 3, np.int32)
    wts = rng.uniform(0.05, 0.5, size=(T, 8)).astype(np.float32)
    ws = _assert_compact_is_the_table(layer, x, ids, wts)
    assert ws.bad_ids() == 0


def test_compact_gateup_bad_ids_are_counted_and_skipped(narrow):
    layer = narrow
    T, k = 12, 8
    x, res, ids, wts, n_bad, ref = _bad_id_inputs(layer, T, k, 7200, "one_expert", more=((7, 5),))
    o8, *_ = _compact_call(layer, x, ids, wts, moe.BULK_GATEUP, res)
    for gu in COMPACT:
        o, y, h, ws = _compact_call(layer, x, ids, wts, gu, res)
        assert ws.bad_ids() == n_bad == 2 + k, gu
        np.testing.assert_array_equal(o, o8, err_msg=str(gu))
        _assert_bad_ids_skipped(o, res, ref)


@pytest.mark.parametrize("gu", COMPACT)
def test_compact_gateup_publishes_its_chunks(narrow, gu):
    # block 0 publishes the gate/up's own sort: chunks of <= xr tokens, the same slots as with chunks of 8
    T = 20
    rng = np.random.default_rng(7300)
    ids, wts = _routing(rng, T, narrow.E, 8, "one_expert")
    x = to_bf16_bits(rng.standard_normal((T, narrow.H)))
    _, chunks = _assert_publishes_the_sort(narrow, x, ids, wts, gu.xr, bulk=True, bulk_tiles=(gu, moe.BULK_DOWN))
    assert chunks[:, 2].max() == gu.xr


@pytest.mark.parametrize("gu", COMPACT)
def test_compact_gateup_graph_replay(narrow, gu):
    # captured once, replayed with new routing written into the same buffers: the sort runs inside the graph
    import cupy as cp
    layer = narrow
    rng = np.random.default_rng(7400 + gu.xr)
    T, k = 16, 8
    x = cp.asarray(to_bf16_bits(rng.standard_normal((T, layer.H))))
    ids, wts = (cp.asarray(a) for a in _routing(rng, T, layer.E, k))
    ws = moe.MoEWorkspace(T, k, layer.w)
    eager = moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True, bulk_tiles=(moe.BULK_GATEUP, moe.BULK_DOWN))
    # eager first (also loads the kernel outside the capture): bit-identical to the table's block
    mine = moe.moe_forward(x, ids, wts, layer.w, ws, bulk=True, bulk_tiles=(gu, moe.BULK_DOWN))
    np.testing.assert_array_equal(mine.get(), eager.get())
    _replay_with_new_routing(layer, rng, x, ids, wts, ws, eager, "one_expert", bulk=True, bulk_tiles=(gu, moe.BULK_DOWN))


def test_compact_gateup_override_and_errors(tiny256, monkeypatch):
    # BULK_TILES = "gu=1,8,2,3,4" runs the compact block through the plain call (what bench.step --moe-bulk-tiles sets);
    # the compact blocks are decode-only (no moe_route feed)
    import cupy as cp
    names = _kernel_names(monkeypatch)
    monkeypatch.setattr(moe.tables, "BULK_TILES", "gu=1,8,2,3,4")
    assert _run(tiny256, 8, 8, seed=7500, bulk=True) < TOL
    assert moe._bulk_name(0, moe.BulkTile(1, 8, 2, 3, 4)) in names and moe._bulk_name(1, moe.BULK_DOWN) in names
    assert moe._bulk_name(0, moe.BulkTile(1, 8, 2, 3, 4)).endswith(", 0, 4>")
    monkeypatch.setattr(moe.tables, "BULK_TILES", "")
    names.clear()
    assert _run(tiny256, 8, 8, seed=7500, bulk=True) < TOL
    assert moe._bulk_name(0, moe.BULK_GATEUP_COMPACT) in names   # the table's gate/up at I <= BULK_COMPACT_MAX_I
    T = 8
    ws = moe.MoEWorkspace(T, 8, tiny256.w)
    x = cp.zeros((T, tiny256.H), cp.uint16)
    ids = cp.zeros((T, 8), cp.int32)
    wts = cp.zeros((T, 8), cp.float32)
    with pytest.raises(ValueError, match="bulk_tiles"):        # G = 1 is not compiled with xr < 8
        moe.moe_forward(x, ids, wts, tiny256.w, ws, bulk=True, fuse_route=False,
                        bulk_tiles=(COMPACT[0], moe.BULK_DOWN))


# ---------------------------------------------------------------------------------------------------------
# The timeline build (docs/MOE.md "Profiling build"): the same kernels
# with per-warp cycle stamps (-DDDT_MOE_TIMELINE, moe_launch_plan timeline=); bench/moe_timeline.py reads them.
# ---------------------------------------------------------------------------------------------------------
def _timeline_call(layer, x, ids, wts, tiles, glob, timeline):
    """One bulk call, h / y / out poisoned, with the given (gate/up, down) blocks, routing source and timeline
    buffers (None: the production build): (out, y bits, h bits)."""
    import cupy as cp
    T, k = ids.shape
    ws = moe.MoEWorkspace(T, k, layer.w)
    ws.y.fill(np.nan)
    ws.h[:, :layer.I] = 0xFFFF
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out, bulk=True,
                    bulk_tiles=tiles, fuse_route=False if glob else None, timeline=timeline)
    return out.get(), ws.y.get().view(np.uint32), ws.h.get()


@pytest.mark.parametrize("layer_name,T,mode,which", [
    ("narrow", 8, "uniform", "table"),         # the decode table: compact gate/up (xr 4, 3 stages), whole-K down
    ("narrow", 8, "uniform", "xr8"),           # the 8-row gate/up block
    ("narrow", 40, "uniform", "large"),        # T*k = 320: moe_route's chunk list (G = 1), the large-T blocks
    ("tiny256", 32, "one_expert", "table"),    # H = 512: one partial 8-step stage per gate/up unit
    ("wide", 9, "uniform", "table")])          # I = 2048: the down's 8 stages per unit, 128 gate/up m-groups
def test_timeline_build_is_bit_identical_and_its_record_holds(layer_name, T, mode, which, request):
    import cupy as cp
    from bench import moe_timeline as mt
    layer = request.getfixturevalue(layer_name)
    rng = np.random.default_rng(7700 + T)
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids, wts = _routing(rng, T, layer.E, 8, mode)
    glob = T * 8 > moe.FUSED_MAX_PAIRS
    gu, dn = moe._bulk_tiles_for(glob, None if glob else layer.I)
    if which == "xr8":
        gu = moe.BULK_GATEUP
    bufs = tuple(cp.full(moe.TL_BLOCKS * moe.timeline_words(bt), -1, dtype=cp.int64) for bt in (gu, dn))
    o0, y0, h0 = _timeline_call(layer, x, ids, wts, (gu, dn), glob, None)
    o1, y1, h1 = _timeline_call(layer, x, ids, wts, (gu, dn), glob, bufs)
    valid = ((ids >= 0) & (ids < layer.E)).reshape(-1)
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(y1[valid], y0[valid])
    if not glob:        # (G = 1: moe_route's atomic ranks may order the slots differently from run to run)
        np.testing.assert_array_equal(h1[:int(valid.sum())], h0[:int(valid.sum())])
    assert np.all(o1 != 0xFFFF)
    if which == "table":     # (the other blocks' production builds are checked against the reference above)
        ref = layer.reference(x, ids, wts)
        got = bf16_bits_to_f32(o1).astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL
    for bt, buf, N, K in ((gu, bufs[0], 2 * layer.I, layer.H), (dn, bufs[1], layer.H, layer.w.inter_padded)):
        lay = mt.Layout(bt.wm * bt.wk + 1, moe.TL_STAGES, moe.TL_UNITS, moe.TL_BLOCKS)
        rec = mt.parse(buf.get(), lay)
        assert mt.check_invariants(rec) == [], bt
        nb = int(rec.valid.sum())
        assert nb > 0 and rec.valid[:nb].all() and not rec.valid[nb:].any(), bt      # blocks 0 .. grid - 1
        # every unit of the kernel ran in exactly one recorded block (when the whole grid was recorded)
        n_chunks = int(rec.bh[0, mt.B_CHUNKS])
        n_units = n_chunks * -(-(N // 32) // bt.wm)
        if nb < moe.TL_BLOCKS:
            assert int(rec.bh[:nb, mt.B_UNITS].sum()) == n_units, bt
        assert (rec.bh[:nb, mt.B_CHUNKS] == n_chunks).all() and (rec.bh[:nb, mt.B_NCW] == bt.wm * bt.wk).all()
        assert (rec.bh[:nb, mt.B_NST] == bt.nst).all() and (rec.bh[:nb, mt.B_SS] == bt.steps).all()
        ks = K // 64       # (by kernel, not by N: tiny256 has N = 512 for both)
        assert (rec.bh[:nb, mt.B_NST_UNIT] == -(-ks // bt.steps)).all()
        # every warp of a block on the block's SM; the analysis runs and its fractions are finite
        res = mt.analyse(rec)
        assert res["blocks"] == nb and np.isfinite(res["roles"]["consumer"]["life"])
        assert res["full_wait"]["n"] == sum(min(int(u) * int(s), moe.TL_STAGES) for u, s in
                                            zip(rec.bh[:nb, mt.B_UNITS], rec.bh[:nb, mt.B_NST_UNIT])) * bt.wm * bt.wk
        assert 0.5 < res["ghz"]["mean"] < 4.0
        assert "copy latency" in mt.report(res)


def test_timeline_argument_errors(narrow):
    import cupy as cp
    T = 8
    rng = np.random.default_rng(7800)
    x = cp.asarray(to_bf16_bits(rng.standard_normal((T, narrow.H))))
    ids, wts = (cp.asarray(a) for a in _routing(rng, T, narrow.E, 8))
    ws = moe.MoEWorkspace(T, 8, narrow.w)
    gu = moe.BULK_GATEUP_COMPACT
    ok = cp.full(moe.TL_BLOCKS * moe.timeline_words(gu), -1, dtype=cp.int64)
    with pytest.raises(ValueError, match="timeline: only the bulk-copy"):
        moe.moe_forward(x, ids, wts, narrow.w, ws, bulk=False, timeline=(ok, None))
    with pytest.raises(ValueError, match=r"timeline\[0\]: must be a 1-D int64 array"):
        moe.moe_forward(x, ids, wts, narrow.w, ws, bulk=True, timeline=(ok[:100], None))
    with pytest.raises(ValueError, match=r"timeline\[0\]: the timeline build has no block"):
        moe.moe_forward(x, ids, wts, narrow.w, ws, bulk=True, bulk_tiles=(moe.BULK_GATEUP_CANDIDATES[0], moe.BULK_DOWN),
                        timeline=(ok, None))
    # one kernel's timeline only: the other runs the production build
    moe.moe_forward(x, ids, wts, narrow.w, ws, bulk=True, timeline=(ok, None))
    assert int(ok[0].get()) == 0x544C424B
