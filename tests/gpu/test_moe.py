"""GPU tests of the fused INT4 MoE (ddtree_cupy/kernels/moe/) against a float64 numpy reference.

Fresh random INT4 weights/scales and bf16 activations every case; outputs (and the y workspace) poisoned
with NaN before each launch; error in relative Frobenius norm. bf16 output + bf16 h give ~3e-3; a wrong
index gives O(1).
"""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
from ddtree_cupy.kernels import moe

pytestmark = pytest.mark.gpu
TOL = 1e-2


def _rand_linear(rng, E, N, K):
    words = rng.integers(0, 2 ** 32, size=(E, N, K // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
    scale = rng.uniform(0.004, 0.03, size=(E, N, K // 32)).astype(np.float32)
    return words, to_bf16_bits(scale)


class Layer:
    def __init__(self, seed, E, H, I):
        import cupy as cp
        rng = np.random.default_rng(seed)
        self.E, self.H, self.I = E, H, I
        self.host = {}
        for name, (N, K) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            self.host[name] = _rand_linear(rng, E, N, K)
        dev = {n: (cp.asarray(p), cp.asarray(s)) for n, (p, s) in self.host.items()}
        self.w = moe.pack_moe_weights(*dev["gate"], *dev["up"], *dev["down"])

    def dense(self, name, experts):
        p, s = self.host[name]
        return {int(e): moe.dequant_numpy(p[e], s[e]) for e in experts}

    def reference(self, x_bits, ids, wts, res_bits=None):
        used = np.unique(ids)
        g, u, d = self.dense("gate", used), self.dense("up", used), self.dense("down", used)
        x = bf16_bits_to_f32(x_bits)
        res = None if res_bits is None else bf16_bits_to_f32(res_bits)
        E = self.E
        gate = [g.get(e, np.zeros(1)) for e in range(E)]
        up = [u.get(e, np.zeros(1)) for e in range(E)]
        down = [d.get(e, np.zeros(1)) for e in range(E)]
        return moe.moe_reference(x, ids, wts, gate, up, down, residual=res)


def _routing(rng, T, E, k, mode="uniform"):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    if mode == "one_expert":            # every token routes to expert 3 (plus k-1 others)
        for t in range(T):
            others = [e for e in rng.permutation(E) if e != 3][:k - 1]
            ids[t] = [3] + others
    elif mode == "duplicates":          # repeated ids inside a token: expert 5 twice everywhere, 3x in token 0
        ids[:, 1] = 5
        ids[:, 2] = 5
        ids[0, 3] = 5
    wts = rng.uniform(0.05, 0.5, size=(T, k)).astype(np.float32)
    return ids, wts


def _run(layer, T, k, seed, mode="uniform", residual=False, t_max=None, tiles=None, **kw):
    import cupy as cp
    rng = np.random.default_rng(seed)
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids, wts = _routing(rng, T, layer.E, k, mode)
    res = to_bf16_bits(rng.standard_normal((T, layer.H))) if residual else None
    ws = moe.MoEWorkspace(t_max or T, k, layer.w)
    ws.y.fill(np.nan)
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out,
                    residual=None if res is None else cp.asarray(res), tiles=tiles, **kw)
    got = bf16_bits_to_f32(out.get()).astype(np.float64)
    ref = layer.reference(x, ids, wts, res)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert ws.bad_ids() == 0
    return err


@pytest.fixture(scope="module")
def tiny():
    return Layer(1, E=32, H=512, I=32)


@pytest.fixture(scope="module")
def tiny256():
    return Layer(2, E=32, H=512, I=256)


@pytest.fixture(scope="module")
def narrow():
    return Layer(3, E=64, H=7168, I=256)


@pytest.fixture(scope="module")
def wide():
    return Layer(4, E=16, H=7168, I=2048)


@pytest.mark.parametrize("layer_name", ["tiny", "tiny256", "narrow", "wide"])
def test_repack_matches_numpy_model_and_dequantises_exactly(layer_name, request):
    layer = request.getfixturevalue(layer_name)
    E = min(layer.E, 4)
    w = layer.w
    for name, wp, sp, srcs in (("gate/up", w.w13, w.s13, ("gate", "up")), ("down", w.w2, w.s2, ("down",))):
        hp = [layer.host[s] for s in srcs]
        args = [a[:E] for pair in hp for a in pair]
        want_wp, want_sp = moe.repack_numpy(*args)
        np.testing.assert_array_equal(wp[:E].get(), want_wp, err_msg=name)
        np.testing.assert_array_equal(sp[:E].get(), want_sp, err_msg=name)
        dense = moe.dequant_packed(wp[:E], sp[:E], wp.shape[1] * 16).get()
        parts = [moe.dequant_numpy(p[:E], s[:E]) for p, s in hp]
        if len(parts) == 2:
            N, K = parts[0].shape[1:]
            want = np.stack([parts[0].reshape(E, N // 16, 16, K), parts[1].reshape(E, N // 16, 16, K)],
                            axis=2).reshape(E, 2 * N, K)
        else:
            want = parts[0]
        K = want.shape[-1]
        np.testing.assert_array_equal(dense[:, :, :K], want, err_msg=name)   # bit-exact q * scale
        assert np.all(dense[:, :, K:] == 0)


@pytest.mark.parametrize("T", [1, 37, 650])
def test_tiny_i32(tiny, T):
    assert _run(tiny, T, 8, seed=T) < TOL


def test_tiny_i256_residual(tiny256):
    assert _run(tiny256, 5, 8, seed=11, residual=True) < TOL


@pytest.mark.parametrize("T", [1, 64, 650])
def test_narrow_h7168_i256(narrow, T):
    assert _run(narrow, T, 8, seed=100 + T) < TOL


@pytest.mark.parametrize("T", [1, 40])
def test_wide_h7168_i2048(wide, T):
    assert _run(wide, T, 8, seed=200 + T) < TOL


@pytest.mark.parametrize("T", [20, 100])
def test_all_tokens_share_one_expert(narrow, T):
    # expert 3 gets every token (several 8/16/32-token chunks); T=20 on 64 experts leaves experts idle
    assert _run(narrow, T, 8, seed=300 + T, mode="one_expert") < TOL


def test_every_table_configuration(tiny256):
    # T*k = 256 (the most pairs the register ring runs), every token on one expert: 4 chunks of 8
    for tiles in moe.all_table_tiles():
        assert _run(tiny256, 32, 8, seed=400, mode="one_expert", tiles=tiles) < TOL, tiles


@pytest.mark.parametrize("pf_steps", [0, 16, 8])
def test_prefetch_settings_do_not_change_results(narrow, pf_steps):
    assert _run(narrow, 32, 8, seed=800, pf_steps=pf_steps, bulk=False) < TOL


def test_the_register_ring_sorts_the_routing_itself(tiny256):
    # the routing kernel feeds the bulk-copy GEMMs only: asking the register ring for it is an error
    import cupy as cp
    ws = moe.MoEWorkspace(4, 8, tiny256.w)
    x, ids, wts = cp.zeros((4, tiny256.H), cp.uint16), cp.zeros((4, 8), cp.int32), cp.zeros((4, 8), cp.float32)
    for kw in (dict(fuse_route=False), dict(l2_prefetch=True)):
        with pytest.raises(ValueError, match="fuse_route, l2_prefetch"):
            moe.moe_forward(x, ids, wts, tiny256.w, ws, bulk=False, **kw)
        with pytest.raises(ValueError, match="fuse_route, l2_prefetch"):
            moe.moe_forward(x, ids, wts, tiny256.w, ws, tiles=moe.select_tiles("sm_90", 4, 256), **kw)


@pytest.mark.parametrize("fuse_route", [True, False])
def test_route_paths(narrow, fuse_route):
    # T = 20 with every token on expert 3: a 20-pair expert is 3 chunks, so the per-block shared-memory sort
    # of every gate/up block must agree with block 0's published one (deterministic ranks); fuse_route=False: the
    # routing kernel feeds the bulk-copy GEMMs (also at T = 1, where the table runs the register ring)
    kw = dict(fuse_route=fuse_route, l2_prefetch=False)
    assert _run(narrow, 20, 8, seed=1000, mode="one_expert", **kw) < TOL
    assert _run(narrow, 1, 8, seed=1001, **kw) < TOL


@pytest.mark.parametrize("fuse_route", [True, False])
def test_route_paths_wide(wide, fuse_route):
    assert _run(wide, 9, 8, seed=1100, fuse_route=fuse_route, l2_prefetch=False) < TOL


@pytest.mark.parametrize("fuse_route", [True, False])
def test_duplicate_ids_in_a_token(tiny256, fuse_route):
    assert _run(tiny256, 12, 8, seed=1200, mode="duplicates", fuse_route=fuse_route, l2_prefetch=False,
                residual=True) < TOL


@pytest.mark.parametrize("T,mode", [(1, "uniform"), (20, "one_expert"), (32, "duplicates")])
def test_fused_sort_publishes_the_model(narrow, T, mode):
    # block 0 of the gate/up kernel publishes its shared-memory sort; every block computes the same one, so
    # it must equal the deterministic numpy model exactly (and the layer must still be right)
    rng = np.random.default_rng(1500 + T)
    ids, wts = _routing(rng, T, narrow.E, 8, mode)
    x = to_bf16_bits(rng.standard_normal((T, narrow.H)))
    # the chunk size of the sort that runs: the table's bulk gate/up block's token rows, the ring's 8
    chunk = moe._bulk_tiles_for(False, narrow.w.inter)[0].xr if moe.bulk_for(T, 8) else 8
    out, _ = _assert_publishes_the_sort(narrow, x, ids, wts, chunk, fuse_route=True)
    ref = narrow.reference(x, ids, wts)
    got = bf16_bits_to_f32(out.get()).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL


def _assert_publishes_the_sort(layer, x, ids, wts, chunk, **kw):
    """One call with the chunk list and the slot map poisoned: block 0 of the gate/up published its shared-memory
    sort, equal to the numpy model with chunks of ``chunk`` tokens exactly. -> (out, the model's chunks)."""
    import cupy as cp
    T, k = ids.shape
    ws = moe.MoEWorkspace(T, k, layer.w)
    ws.chunks.fill(-7)
    ws.slot_pair.fill(-7)
    out = moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, **kw)
    chunks, slot_pair, bad = moe.fused_sort_numpy(ids, layer.E, chunk)
    assert int(ws.meta[0].get()) == len(chunks) and ws.bad_ids() == bad == 0
    np.testing.assert_array_equal(ws.chunks[:len(chunks), :3].get(), chunks[:, :3])
    np.testing.assert_array_equal(ws.slot_pair[:len(slot_pair)].get(), slot_pair)
    return out, chunks


def test_fused_route_every_table_configuration(tiny256):
    # the shared-memory sort with 8/16/32-token chunks (T*k = 160 <= FUSED_MAX_PAIRS)
    for tiles in moe.all_table_tiles():
        assert _run(tiny256, 20, 8, seed=1300, mode="one_expert", tiles=tiles, fuse_route=True) < TOL, tiles


def test_prefetch_variants(narrow, wide):
    # the prefetch never changes a result, but a wrong address in it would fault
    assert _run(narrow, 16, 8, seed=1400, pf_next=False) < TOL
    assert _run(narrow, 16, 8, seed=1401, pf_steps=16) < TOL
    assert _run(wide, 5, 8, seed=1403, pf_steps=4) < TOL


def _out_and_y(layer, T, k, seed, mode="uniform", **kw):
    """One layer call on inputs fixed by ``seed`` with poisoned out/y: (out bits, y bits, x, ids, wts)."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids, wts = _routing(rng, T, layer.E, k, mode)
    ws = moe.MoEWorkspace(T, k, layer.w)
    ws.y.fill(np.nan)
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out, **kw)
    return out.get(), ws.y.get().view(np.uint32), x, ids, wts


@pytest.mark.parametrize("layer_name,T,mode", [
    ("narrow", 1, "uniform"), ("narrow", 8, "uniform"), ("narrow", 20, "one_expert"), ("narrow", 32, "uniform"),
    ("wide", 5, "uniform"), ("wide", 24, "uniform"), ("tiny", 32, "uniform"),
    ("tiny256", 32, "one_expert"), ("tiny256", 32, "duplicates")])
def test_the_two_k_loops_are_bit_identical(layer_name, T, mode, request):
    # the two k loops (LEAN = 1, 2) do the same arithmetic in the same order: y (fp32 per pair) and out must
    # match bit for bit, for every table shape (K = 1 step per warp in the tiny layers, 14 in the H = 7168
    # ones, 3- and 4-chunk experts), and be right
    layer = request.getfixturevalue(layer_name)
    tab = moe.select_tiles("sm_90", T, layer.I)
    o1, y1, x, ids, wts = _out_and_y(layer, T, 8, 1700 + T, mode, tiles=moe.with_lean(tab, 1))
    o2, y2, *_ = _out_and_y(layer, T, 8, 1700 + T, mode, tiles=moe.with_lean(tab, 2))
    np.testing.assert_array_equal(y2, y1)
    np.testing.assert_array_equal(o2, o1)
    ref = layer.reference(x, ids, wts)
    got = bf16_bits_to_f32(o1).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL


@pytest.mark.parametrize("layer_name", ["narrow", "wide"])
@pytest.mark.parametrize("lean", [1, 2])
def test_k_loop_prefetch_settings_are_bit_identical(layer_name, lean, request):
    # the k loops' prefetch (per step, next unit at the unit start or across the unit boundary) changes no
    # result, and a wrong address in it would fault: every pf_steps / pf_next setting against the table's
    # loop from T = 2 up with its defaults
    layer = request.getfixturevalue(layer_name)
    T = 16
    tab = moe.select_tiles("sm_90", T, layer.I)
    o0, y0, *_ = _out_and_y(layer, T, 8, 1800, tiles=moe.with_lean(tab, 2))
    for kw in (dict(pf_steps=0), dict(pf_steps=4), dict(pf_steps=16), dict(pf_next=False),
               dict(pf_steps=16, pf_next=False)):
        o1, y1, *_ = _out_and_y(layer, T, 8, 1800, tiles=moe.with_lean(tab, lean), **kw)
        np.testing.assert_array_equal(y1, y0, err_msg=str(kw))
        np.testing.assert_array_equal(o1, o0, err_msg=str(kw))


def test_small_t_in_large_workspace(narrow):
    assert _run(narrow, 3, 8, seed=500, t_max=650) < TOL


def _replay_with_new_routing(layer, rng, x, ids, wts, ws, eager, mode, **kw):
    """moe_forward(..., **kw) run once on a non-blocking stream, then captured there: the replay equals ``eager``
    bit for bit; then new routing (``mode``) written into the same ids / wts buffers and replayed: right against
    the float64 reference (the sort / route runs inside the graph)."""
    import cupy as cp
    T, k = ids.shape
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Stream.null.synchronize()  # null-stream work is not ordered before a non-blocking stream
    with stream:
        moe.moe_forward(x, ids, wts, layer.w, ws, out=out, **kw)
        stream.synchronize()
        stream.begin_capture()
        moe.moe_forward(x, ids, wts, layer.w, ws, out=out, **kw)
        graph = stream.end_capture()
        out.fill(0xFFFF)
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(out.get(), eager.get())
    ids2, wts2 = _routing(rng, T, layer.E, k, mode)
    ids[...] = cp.asarray(ids2)
    wts[...] = cp.asarray(wts2)
    cp.cuda.Stream.null.synchronize()  # the null-stream writes above are not ordered before a non-blocking stream
    with stream:
        out.fill(0xFFFF)
        graph.launch(stream)
        stream.synchronize()
    ref = layer.reference(x.get(), ids2, wts2)
    got = bf16_bits_to_f32(out.get()).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL


@pytest.mark.parametrize("fused,bulk", [(True, False), (False, True), (True, True)])
def test_graph_replay_equals_eager(tiny256, fused, bulk):
    import cupy as cp
    layer = tiny256
    rng = np.random.default_rng(600)
    T, k = 24, 8
    fz = dict(fuse_route=fused, l2_prefetch=False, bulk=bulk)
    x = cp.asarray(to_bf16_bits(rng.standard_normal((T, layer.H))))
    ids, wts = (cp.asarray(a) for a in _routing(rng, T, layer.E, k))
    ws = moe.MoEWorkspace(T, k, layer.w)
    eager = moe.moe_forward(x, ids, wts, layer.w, ws, **fz)
    _replay_with_new_routing(layer, rng, x, ids, wts, ws, eager, "uniform", **fz)


def _bad_id_inputs(layer, T, k, seed, mode="uniform", more=()):
    """Inputs with out-of-range expert ids: ids[1, 2] = E, -3 at each (t, j) of ``more``, and token 3 with no valid id
    at all (its out must be its residual). -> (x, res, ids, wts, n_bad, reference)."""
    rng = np.random.default_rng(seed)
    x = to_bf16_bits(rng.standard_normal((T, layer.H)))
    res = to_bf16_bits(rng.standard_normal((T, layer.H)))
    ids, wts = _routing(rng, T, layer.E, k, mode)
    ids[1, 2] = layer.E          # out of range
    for t, j in more:
        ids[t, j] = -3
    ids[3, :] = -1               # token 3 has no valid expert at all: out = residual
    w_ref, ids_ref = wts.copy(), ids.copy()
    for t, j in ((1, 2),) + tuple(more):
        w_ref[t, j], ids_ref[t, j] = 0.0, 0
    w_ref[3, :] = 0.0
    ids_ref[3, :] = np.arange(k)
    return x, res, ids, wts, 1 + len(more) + k, layer.reference(x, ids_ref, w_ref, res)


def _assert_bad_ids_skipped(out_bits, res, ref):
    """The layer's output with bad ids: right against the reference that gives them weight 0, and token 3 (no valid
    id) exactly its residual (bf16(0 + residual) == residual)."""
    got = bf16_bits_to_f32(out_bits).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL
    np.testing.assert_array_equal(out_bits[3], res[3])


@pytest.mark.parametrize("fuse_route,bulk", [(True, False), (False, True), (True, True)])
def test_bad_ids_are_counted_and_skipped(tiny256, fuse_route, bulk):
    import cupy as cp
    layer = tiny256
    T, k = 4, 8
    x, res, ids, wts, n_bad, ref = _bad_id_inputs(layer, T, k, 700)
    ws = moe.MoEWorkspace(T, k, layer.w)
    out = cp.full((T, layer.H), 0xFFFF, dtype=cp.uint16)
    moe.moe_forward(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), layer.w, ws, out=out,
                    residual=cp.asarray(res), fuse_route=fuse_route, l2_prefetch=False, bulk=bulk)
    assert ws.bad_ids() == n_bad == 1 + k
    _assert_bad_ids_skipped(out.get(), res, ref)


def test_argument_errors_name_the_argument(tiny256):
    import cupy as cp
    layer = tiny256
    ws = moe.MoEWorkspace(4, 8, layer.w)
    x = cp.zeros((4, layer.H), cp.uint16)
    ids = cp.zeros((4, 8), cp.int32)
    wts = cp.zeros((4, 8), cp.float32)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_forward(x, ids.astype(cp.int64), wts, layer.w, ws)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.moe_forward(x, ids, wts[:, :7], layer.w, ws)
    with pytest.raises(ValueError, match="t_max"):
        moe.moe_forward(cp.zeros((5, layer.H), cp.uint16), cp.zeros((5, 8), cp.int32),
                        cp.zeros((5, 8), cp.float32), layer.w, ws)
    with pytest.raises(ValueError, match="x"):
        moe.moe_forward(x[:, :256], ids, wts, layer.w, ws)
    p, s = (cp.asarray(a) for a in layer.host["gate"])
    with pytest.raises(ValueError, match="down_packed"):
        moe.pack_moe_weights(p, s, p, s, p, s)
