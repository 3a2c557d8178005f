"""The persistent layer executor (kernels/persistent.py, cuda_src/persistent_layer.cu) on the dense MLP half
of a layer (target dense layer 0 and drafter shapes, TP = 8 rank widths): against a float64 numpy reference
and today's kernel chain (rms_norm, gemm_bf16, silu_mul; the norm bit for bit, the stream-K GEMMs to bf16
rounding: their K sums run in another order), on fresh random weights and inputs with every output poisoned
first; the same bits run to run; graph replay == eager; smaller grids; the wait bound and the co-residency
refusal."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, f64, poisoned, rand_bf16, rel_err
from ddtree_cupy.engine import schedule as S

pytestmark = pytest.mark.gpu

H_KIMI, F_DENSE, F_DRAFT = 7168, 18432 // 8, 18432 // 8


def _shape(kind, T, H, F):
    if kind == "dense":
        return S.LayerShape("dense", 1, T, H=H, nh=8, ql=1536, dn=128, dv=128, F=F)
    return S.LayerShape("drafter", 1, T, H=H, nh=8, dn=128, dv=128, F=F, nkv=1)


def _problem(cp, T, H, F, seed):
    rng = np.random.default_rng(seed)
    attn_b, attn = rand_bf16(rng, (T, H))
    h_b, h = rand_bf16(rng, (T, H))
    nw_b, nw = rand_bf16(rng, (H,))
    gu_b, gu = rand_bf16(rng, (2 * F, H), H ** -0.5)
    dn_b, dn = rand_bf16(rng, (H, F), F ** -0.5)
    dev = {k: cp.asarray(v) for k, v in dict(attn=attn_b, h=h_b, nw=nw_b, w_gu=gu_b, w_dn=dn_b).items()}
    return dev, dict(attn=attn, h=h, nw=nw, w_gu=gu, w_dn=dn)


def _reference(p, eps):
    """float64: h' = bf16(h + attn); normed = norm(h'); act = silu(g) u; out = act @ w_dn^T. The residual and
    normed rows are rounded to bf16 as the kernels store them, so the reference sees what they read."""
    from ddtree_cupy.bf16 import bf16_bits_to_f32, to_bf16_bits
    r = lambda a: bf16_bits_to_f32(to_bf16_bits(a)).astype(np.float64)      # noqa: E731
    hp = r(p["h"] + p["attn"])
    normed = r(p["nw"] * hp / np.sqrt(np.mean(hp * hp, axis=1, keepdims=True) + eps))
    gu = r(normed @ p["w_gu"].T)
    F = gu.shape[1] // 2
    g, u = gu[:, :F], gu[:, F:]
    act = r(g / (1 + np.exp(-g)) * u)
    return hp, normed, act @ p["w_dn"].T


def _buffers(cp, T, H, F):
    return dict(normed=poisoned(cp, (T, H)), act=poisoned(cp, (T, F)), out=poisoned(cp, (T, H)),
                final=poisoned(cp, (T, H)))


def _build(shape, n_blocks, **kw):
    kw.setdefault("parts", ("mlp",))
    return S.build_layer(shape, n_blocks, **kw)


def _segment(cp, sc, dev, bufs, h, eps, **kw):
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_dense_mlp
    ops = bind_dense_mlp(sc, attn=dev["attn"], h=h, post_norm_w=dev["nw"], eps=eps, w_gate_up=dev["w_gu"],
                         w_down=dev["w_dn"], normed=bufs["normed"], act=bufs["act"], out=bufs["out"],
                         final=bufs["final"])
    return PersistentSegment(sc, 0, ops, **kw)


def _today(cp, dev, T, H, F, eps):
    """Today's chain (its automatic GEMM configs)."""
    from ddtree_cupy.kernels import gemm, layers
    h = dev["h"].copy()
    normed, gu, act, out = (poisoned(cp, s) for s in ((T, H), (T, 2 * F), (T, F), (T, H)))
    layers.rms_norm(dev["attn"], dev["nw"], eps, out=normed, residual=h)
    gemm.gemm_bf16(normed, dev["w_gu"], gu)
    layers.silu_mul(gu, out=act)
    gemm.gemm_bf16(act, dev["w_dn"], out)
    return h, normed, act, out


@pytest.mark.parametrize("kind,T", [("dense", 8), ("dense", 1), ("dense", 16), ("drafter", 8)])
@pytest.mark.parametrize("allreduce", ["item", "segment"])
def test_mlp_half_matches_reference_and_today(kind, T, allreduce):
    import cupy as cp
    from ddtree_cupy.kernels.persistent import default_grid
    H, F = H_KIMI, (F_DENSE if kind == "dense" else F_DRAFT)
    eps = 1e-6
    sc = _build(_shape(kind, T, H, F), default_grid(), allreduce=allreduce)
    dev, p = _problem(cp, T, H, F, seed=T + len(kind))
    bufs = _buffers(cp, T, H, F)
    h = dev["h"].copy()
    seg = _segment(cp, sc, dev, bufs, h, eps)
    seg.launch()
    seg.check()
    hp, normed, out = _reference(p, eps)
    assert rel_err(f64(h), hp) < 1e-6                       # the residual add: one bf16 rounding of the sum
    assert rel_err(f64(bufs["normed"]), normed) < BF16_TOL
    assert rel_err(f64(bufs["out"]), out) < 2 * BF16_TOL
    if allreduce == "item":                                 # the TP = 1 boundary item copies out
        assert np.array_equal(bufs["final"].get(), bufs["out"].get())
    # today's chain: the norm bit for bit (the same body), the GEMMs up to their K summation order
    th, tn, ta, to = _today(cp, dev, T, H, F, eps)
    assert np.array_equal(h.get(), th.get())
    assert np.array_equal(bufs["normed"].get(), tn.get())
    assert rel_err(f64(bufs["act"]), f64(ta)) < BF16_TOL
    assert rel_err(f64(bufs["out"]), f64(to)) < BF16_TOL
    # the same bits on a second launch (fixed slot order in every fixup, whichever part arrives last)
    first = {k: v.get() for k, v in bufs.items()}
    for b in bufs.values():
        b.fill(0xFFFF)
    h[...] = dev["h"]
    seg.launch()
    seg.check()
    for k, v in bufs.items():
        if allreduce == "item" or k != "final":
            assert np.array_equal(v.get(), first[k]), f"{k} changed between launches"


def _check_counter_sets(seg, launches):
    # launch g (0-based) used counter set g & 1 and zeroed the other, which the next launch uses: after the
    # last launch its set holds every counter's target and the other set is all zero
    c = seg.counters.get().reshape(2, -1)
    used = (launches - 1) & 1
    assert (seg.launches.get() == launches).all()
    assert not c[1 - used].any(), "the next launch's counter set was not zeroed"
    np.testing.assert_array_equal(c[used], np.asarray(seg.s.counter_targets, np.int32))


def test_graph_replay_equals_eager_and_counters_reset():
    import cupy as cp
    T, H, F, eps = 8, H_KIMI, F_DENSE, 1e-6
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    sc = _build(_shape("dense", T, H, F), sm, allreduce="item")
    dev, _ = _problem(cp, T, H, F, seed=11)
    bufs = _buffers(cp, T, H, F)
    h = dev["h"].copy()
    seg = _segment(cp, sc, dev, bufs, h, eps)
    h0 = h.copy()
    seg.launch()
    seg.check()
    ref = {k: v.get() for k, v in bufs.items()}
    _check_counter_sets(seg, 1)
    launches = 1
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        h[...] = h0                                          # the residual is updated in place: restore it
        seg.launch()
        g = s.end_capture()
        for _ in range(4):
            for b in bufs.values():
                b.fill(0xFFFF)
            g.launch(s)
            s.synchronize()
            seg.check()
            launches += 1
            _check_counter_sets(seg, launches)
            for k, v in bufs.items():
                assert np.array_equal(v.get(), ref[k]), f"graph replay changed {k}"


@pytest.mark.parametrize("n_blocks", [1, 3, 17])
def test_smaller_grid_completes_identically(n_blocks):
    import cupy as cp
    T, H, F, eps = 8, H_KIMI, F_DENSE, 1e-6
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    dev, _ = _problem(cp, T, H, F, seed=5)
    outs = []
    for nb in (sm, n_blocks):
        sc = _build(_shape("dense", T, H, F), nb, allreduce="item")
        bufs = _buffers(cp, T, H, F)
        seg = _segment(cp, sc, dev, bufs, dev["h"].copy(), eps)
        seg.launch()
        seg.check()
        outs.append(bufs["out"].get())
    # another grid cuts other K ranges: the same numbers up to summation order
    assert rel_err(f64(cp.asarray(outs[1])), f64(cp.asarray(outs[0]))) < BF16_TOL


def test_wait_timeout_sets_error_not_hang():
    import cupy as cp
    T, H, F, eps = 8, H_KIMI, F_DENSE, 1e-6
    sc = _build(_shape("dense", T, H, F), 4, allreduce="item")
    victim = next(it for it in sc.items if it.op == "down")
    victim.waits = victim.waits[:-1] + ((victim.waits[-1][0], victim.waits[-1][1] + 1000),)   # never met
    dev, _ = _problem(cp, T, H, F, seed=2)
    seg = _segment(cp, sc, dev, _buffers(cp, T, H, F), dev["h"].copy(), eps, spin_limit=20000)
    seg.launch()
    with pytest.raises(RuntimeError, match=r"\(stage (down|allreduce_mlp), kind (gemm_part|boundary)\) failed: "
                                           r"a dependency wait timed out"):
        seg.check()
    assert int(seg.counters.sum().get()) == 0            # check() reset them: the next launch is clean


def test_timeline_has_every_item_on_its_scheduled_block():
    import cupy as cp
    T, H, F, eps = 8, H_KIMI, F_DENSE, 1e-6
    sc = _build(_shape("dense", T, H, F), 7, allreduce="item")
    dev, _ = _problem(cp, T, H, F, seed=4)
    seg = _segment(cp, sc, dev, _buffers(cp, T, H, F), dev["h"].copy(), eps, trace=True)
    seg.launch()
    seg.check()
    tl = seg.timeline()
    enc = sc.encode(0)
    bs = enc["block_start"]
    assert sorted(i for _, i, _, _, _ in tl) == list(range(len(enc["items"])))
    for b, i, op, t0, t1 in tl:
        assert bs[b] <= i < bs[b + 1], f"item {i} traced on block {b}"
        assert op == sc.ops[int(enc["items"][i, 1])] and 0 < t0 <= t1
    # a block runs its list in order (the parts of one GEMM run share the run's start, their ends in order)
    bt = seg.block_times()
    for b in range(sc.n_blocks):
        spans = sorted((i, t0, t1) for bb, i, _, t0, t1 in tl if bb == b)
        assert all((spans[j][1] == spans[j + 1][1] and spans[j][2] <= spans[j + 1][2]) or spans[j][2] <= spans[j + 1][1]
                   for j in range(len(spans) - 1))
        # the block's own times: start <= set-up done <= its first item's start, its last item's end <= its end
        assert 0 < bt[b, 0] <= bt[b, 1] <= min(s[1] for s in spans) and max(s[2] for s in spans) <= bt[b, 2]
    # the SM each block ran on: a real SM id, at most the resident blocks per SM on each
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    assert bt.shape == (sc.n_blocks, 4) and (bt[:, 3] >= 0).all() and (bt[:, 3] < sm).all()
    assert np.bincount(bt[:, 3]).max() <= seg.blocks_per_sm


def test_grid_that_cannot_be_coresident_is_refused():
    import cupy as cp
    T, H, F = 8, H_KIMI, F_DENSE
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    sc = _build(_shape("dense", T, H, F), 4 * sm + 1, allreduce="item")
    dev, _ = _problem(cp, T, H, F, seed=3)
    with pytest.raises(ValueError, match="cannot be co-resident"):
        _segment(cp, sc, dev, _buffers(cp, T, H, F), dev["h"].copy(), 1e-6)


def test_unsupported_rows_and_kinds_are_refused():
    import cupy as cp
    from ddtree_cupy.kernels.persistent import PersistentSegment
    sc = S.build_layer(S.LayerShape("dense", 4, 8, H=H_KIMI, nh=8, ql=1536, dn=128, dv=128, F=F_DENSE), 8,
                       parts=("mlp",))
    with pytest.raises(ValueError, match="T = 32"):
        PersistentSegment(sc, 0, {})
    sc = S.build_layer(_shape("dense", 8, H_KIMI, F_DENSE), 8)
    with pytest.raises(ValueError, match="does not run"):
        PersistentSegment(sc, 0, {})


# ------------------------------------------------------------------------------------------- the engine path
@pytest.fixture(scope="module")
def tiny_target():
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.models.weights import GpuTargetWeights
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, _ = ensure_tiny_checkpoints()
    cfg = TargetConfig.load(tdir)
    return cfg, GpuTargetWeights.from_checkpoint(tdir, cfg, 0, 1)


def _forward(cfg, w, on, S_, R, seed, graph=False):
    import cupy as cp
    from ddtree_cupy.kernels import persistent
    from ddtree_cupy.models.batch import TargetBatch
    from ddtree_cupy.models.kv import GpuLatentCache
    from ddtree_cupy.models.target import GpuTarget
    old = persistent.set_mlp(on)
    try:
        tgt = GpuTarget(cfg, w, None, max_tokens=S_ * R)
        kv = GpuLatentCache(cfg.num_hidden_layers, S_ + 1, S_, 1)
        kv.set_block_table(np.arange(S_).reshape(S_, 1))
        for p in kv.pools:
            p.fill(0xFFFF)
        for name in ("h", "normed", "attn_out", "mlp_out", "gate_up", "act"):
            getattr(tgt, name).fill(0xFFFF)
        rng = np.random.default_rng(seed)
        b = TargetBatch(S_, R, cfg, 1, 0, tree=False)
        b.set(tokens=rng.integers(0, cfg.vocab_size, (S_, R)), positions=np.tile(np.arange(R), (S_, 1)),
              n_rows=np.full(S_, R), prefix_len=np.zeros(S_, int))
        b.logits.fill(np.nan)
        names = [n for n, _ in tgt.layer_stages(0, b, kv)]
        tgt.forward(b, kv)
        eager = b.logits.get()
        if not graph:
            return eager, names
        st = cp.cuda.Stream(non_blocking=True)
        with st:
            st.begin_capture()
            tgt.forward(b, kv)
            g = st.end_capture()
            out = []
            for _ in range(2):
                b.logits.fill(np.nan)
                g.launch(st)
                st.synchronize()
                out.append(b.logits.get())
        return eager, names, out
    finally:
        persistent.set_mlp(old)


@pytest.mark.parametrize("S_,R", [(1, 8), (2, 8), (1, 3)])
def test_target_with_persistent_mlp_equals_today(tiny_target, S_, R):
    cfg, w = tiny_target
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if not dense:
        pytest.skip("the tiny model has no dense layer")
    off, names_off = _forward(cfg, w, False, S_, R, seed=S_ * 10 + R)
    on, names_on = _forward(cfg, w, True, S_, R, seed=S_ * 10 + R)
    assert "mlp_persistent" in names_on and "mlp_persistent" not in names_off
    assert np.all(np.isfinite(on))
    # the same model up to the GEMM tiles' summation order in the dense layer(s)
    assert rel_err(on, off) < 2e-2
    assert np.mean(on.argmax(-1) == off.argmax(-1)) >= 0.9


def test_target_persistent_mlp_graph_replay_equals_eager(tiny_target):
    cfg, w = tiny_target
    if all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        pytest.skip("the tiny model has no dense layer")
    eager, _, replays = _forward(cfg, w, True, 1, 8, seed=4, graph=True)
    for r in replays:
        assert np.array_equal(r.view(np.uint32), eager.view(np.uint32))


def test_target_persistent_mlp_above_16_rows_keeps_today(tiny_target):
    cfg, w = tiny_target
    _, names = _forward(cfg, w, True, 2, 12, seed=1)        # T = 24 > MAX_T
    assert "mlp_persistent" not in names and "post_norm" in names


# the drafter's fixture and helpers (tiny checkpoints, float64 reference drafter)
from test_drafter_model import TOL as DRAFT_TOL, make_drafter, rel, tiny  # noqa: E402,F401


@pytest.mark.parametrize("S_", [1, 2])
def test_drafter_with_persistent_mlp_matches_reference(tiny, S_):      # noqa: F811
    import cupy as cp
    from ddtree_cupy.bf16 import bf16_bits_to_f32
    from ddtree_cupy.kernels import persistent
    from ddtree_cupy.reference.drafter import ReferenceDrafter
    dcfg = tiny["dcfg"]
    old = persistent.set_mlp(True)
    try:
        dr = make_drafter(tiny, dcfg, max_ctx=64)
        ref = ReferenceDrafter(dcfg, tiny["dw"], tiny["embed"], tiny["lm"], np.float64)
        caches = [ref.new_cache() for _ in range(S_)]
        have = []
        for b in range(S_):
            f = tiny["feats"][b]
            n = f.shape[0]
            dr.append_context(cp.asarray(f), cp.asarray(np.full(n, b, np.int32)), cp.asarray(np.arange(n, dtype=np.int32)))
            ref.append_context(caches[b], bf16_bits_to_f32(f).astype(np.float64), np.arange(n))
            have.append(n)
        rng = np.random.default_rng(S_)
        bonus = rng.integers(0, dcfg.vocab_size, S_).astype(np.int32)
        D, V = dcfg.block_size - 1, dcfg.vocab_size
        out = cp.full((S_, D, V), np.nan, cp.float32)
        hv = np.array(have, np.int32)
        dr.draft(cp.asarray(bonus), cp.asarray(hv), cp.asarray(hv), out)
        assert dr._persist, "the persistent MLP path did not engage"
        got = out.get()
        for b in range(S_):
            assert rel(got[b], ref.draft(caches[b], int(bonus[b]), have[b])) < DRAFT_TOL
    finally:
        persistent.set_mlp(old)


@pytest.mark.parametrize("kind,T", [("norm", 1), ("norm", 8), ("gemm", 1), ("gemm", 8), ("gemm", 16)])
def test_dependency_chain_matches_float64_and_today(kind, T):
    # the edge benchmark's chains (bench/persistent_edges.py): each stage reads only the one before it, so a
    # missing or early wait shows as a poisoned or stale stage. Each stage against float64 of the stage
    # before as stored (bf16), and today's kernels: the norm bit for bit (the same body), the GEMM to bf16
    # rounding (stream-K sums K in another order)
    import cupy as cp
    from ddtree_cupy.kernels import gemm, layers
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_chain, default_grid
    rng = np.random.default_rng(40 + T)
    W, n = 1536, 5
    sc = S.build_chain(kind, T, W, n, default_grid())
    xb, _ = rand_bf16(rng, (T, W))
    wb = [rand_bf16(rng, (W,) if kind == "norm" else (W, W), 1.0 if kind == "norm" else W ** -0.5)[0]
          for _ in range(n)]
    xs = [cp.asarray(xb)] + [poisoned(cp, (T, W)) for _ in range(n)]
    ws = [cp.asarray(w) for w in wb]
    seg = PersistentSegment(sc, 0, bind_chain(sc, xs, ws))
    seg.launch()
    seg.check()
    for j in range(n):
        prev, w = f64(xs[j]), f64(ws[j])
        ref = (w * prev / np.sqrt(np.mean(prev * prev, axis=1, keepdims=True) + 1e-6) if kind == "norm"
               else prev @ w.T)
        assert rel_err(f64(xs[j + 1]), ref) < BF16_TOL, f"stage {j}"
        today = cp.zeros((T, W), np.uint16)
        if kind == "norm":
            layers.rms_norm(xs[j], ws[j], 1e-6, out=today)
            assert np.array_equal(today.get(), xs[j + 1].get()), f"stage {j}"
        else:
            gemm.gemm_bf16(xs[j], ws[j], today)
            assert rel_err(f64(xs[j + 1]), f64(today)) < 2 * BF16_TOL, f"stage {j}"
    first = [x.get() for x in xs[1:]]
    seg.launch()                                             # the same bits on a second launch
    seg.check()
    assert all(np.array_equal(a, x.get()) for a, x in zip(first, xs[1:]))
