"""Skinny bf16 GEMM against float64 numpy: every tile size, split-K on/off, batched strided views,
fp32 output, and replay inside a CUDA graph; both families ("splitk", "decode") at every engine shape for
T <= 16, graph replay == eager, and a PDL-launched chain == the plain one; every decode config the selection
can choose, forced, at edge shapes (odd T, strided and batched views, K not a multiple of the slices,
clusters and warps with empty K ranges), bit-identical across repeats and under graph replay.
Every output buffer is filled on the stream that launches the GEMM (a fill on the legacy default stream
is not ordered before work on a non-blocking stream)."""
import numpy as np
import pytest

from _kernel_testutil import (BF16_TOL, check_gemm, f64, gemm_twice, gemm_views, poisoned, rand_bf16, record_kernels,
                              rel_err)
from _kernel_testutil import gemm_weight as _weight

pytestmark = pytest.mark.gpu

SHAPES = [  # (T, K, N): decode rows, every token-tile choice, edge sizes (N not a multiple of 64, K = 64)
    (1, 7168, 576), (2, 512, 2112), (7, 1536, 1536), (8, 64, 16), (9, 128, 48), (16, 7168, 2112),
    (24, 2304, 7168), (33, 1024, 1040), (48, 256, 7168), (64, 7168, 512), (80, 512, 4608),
    (96, 1536, 1536), (128, 7168, 384), (129, 512, 576), (160, 7168, 2112),
]


@pytest.mark.parametrize("T,K,N", SHAPES)
def test_gemm_matches_float64(T, K, N):
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(T * 7919 + K + N)
    xb, x = rand_bf16(rng, (T, K))
    wb, w = rand_bf16(rng, (N, K), 0.05)
    ref = x @ w.T
    out = poisoned(cp, (T, N))
    gemm_bf16(cp.asarray(xb), cp.asarray(wb), out)
    assert rel_err(f64(out), ref) < BF16_TOL
    # Row/column-wise check too: a wrong tile offset can hide in a global norm.
    err_rows = np.linalg.norm(f64(out) - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert err_rows.max() < 4 * BF16_TOL


@pytest.mark.parametrize("T,split", [(13, 1), (13, 2), (13, 7), (40, 3), (1, 16)])
def test_gemm_split_and_fp32_out(T, split):
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(split + T)
    K, N = 1024, 320
    xb, x = rand_bf16(rng, (T, K))
    wb, w = rand_bf16(rng, (N, K), 0.05)
    for _ in range(3):      # repeated launches into a reused workspace
        out = poisoned(cp, (T, N), np.float32)
        gemm_bf16(cp.asarray(xb), cp.asarray(wb), out, out_dtype=np.float32, split_k=split)
        # fp32 output: only accumulation-order error remains
        assert rel_err(out.get(), x @ w.T) < 1e-5
    again = cp.empty((T, N), np.float32)
    gemm_bf16(cp.asarray(xb), cp.asarray(wb), again, out_dtype=np.float32, split_k=split)
    assert cp.array_equal(again, out), "split-K reduction must be deterministic"


@pytest.mark.parametrize("T,K,N,B,split,f32", [
    (1, 7168, 336, 1, 56, False),     # many splits, N % 64 != 0
    (5, 2304, 1040, 3, 6, True),      # batched, partial last column tile, fp32 out
    (160, 7168, 2112, 1, 5, False),   # the largest token tile
    (17, 512, 48, 2, 8, False),       # a single narrow column tile per batch, every k tile its own split
])
def test_gemm_splitk_batched_and_reused_workspace(T, K, N, B, split, f32):
    """Split-K with batches, many splits, partial column tiles and the largest token tile; the same
    workspace serves back-to-back launches with other shapes and splits."""
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(T * 31 + split)
    xb, x = rand_bf16(rng, (B, T, K))
    wb, w = rand_bf16(rng, (B, N, K), 0.05)
    ref = np.einsum("btk,bnk->btn", x, w)
    ws = cp.empty(B * split * T * N + 64, np.float32)
    oxb, ox64 = rand_bf16(rng, (3, 512))
    owb, ow64 = rand_bf16(rng, (128, 512), 0.05)
    ox, ow, oref = cp.asarray(oxb), cp.asarray(owb), ox64 @ ow64.T
    dt = np.float32 if f32 else np.uint16
    outs = []
    for it in range(3):
        out = poisoned(cp, (B, T, N), dt)
        gemm_bf16(cp.asarray(xb), cp.asarray(wb), out, out_dtype=dt, split_k=split, workspace=ws)
        # another shape through the same workspace and tickets in between
        other = poisoned(cp, (3, 128))
        gemm_bf16(ox, ow, other, split_k=4, workspace=ws)
        assert rel_err(f64(other), oref) < BF16_TOL
        got = out.get().astype(np.float64) if f32 else f64(out)
        assert rel_err(got, ref) < (1e-5 if f32 else BF16_TOL)
        per_row = np.linalg.norm(got - ref, axis=2) / np.linalg.norm(ref, axis=2)
        assert per_row.max() < (1e-4 if f32 else 4 * BF16_TOL)
        outs.append(out.get())
    assert all(np.array_equal(o, outs[0]) for o in outs), "split-K reduction must be deterministic"


def test_gemm_batched_strided_views():
    """Per-head products reading q_nope out of q [T, 8, 192] and writing into q_lat [T, 8, 512]."""
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(3)
    T, Hh = 11, 8
    qb, q = rand_bf16(rng, (T, Hh, 192))
    wb, w = rand_bf16(rng, (Hh, 512, 128), 0.1)          # W_UK^T per head: [N=512, K=128]
    q_dev = cp.asarray(qb)
    out = poisoned(cp, (T, Hh, 640))                      # wider rows: the slice [..., :512] is the output
    x_view = q_dev[:, :, :128].transpose(1, 0, 2)         # [B, T, K], strided
    o_view = out[:, :, :512].transpose(1, 0, 2)           # [B, T, N], strided
    gemm_bf16(x_view, cp.asarray(wb), o_view)
    ref = np.einsum("thk,hnk->thn", q[:, :, :128], w)
    got = out.get()
    assert rel_err(f64(cp.asarray(got[:, :, :512].copy())), ref) < BF16_TOL
    assert np.all(got[:, :, 512:] == 0xFFFF), "wrote outside the output view"


def test_gemm_graph_replay():
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    rng = np.random.default_rng(5)
    T, K, N = 4, 2048, 1024
    wb, w = rand_bf16(rng, (N, K), 0.05)
    x_dev, w_dev, out = cp.empty((T, K), np.uint16), cp.asarray(wb), poisoned(cp, (T, N))
    x_dev[:] = cp.asarray(rand_bf16(rng, (T, K))[0])
    gemm_bf16(x_dev, w_dev, out)        # warm-up: compiles, sizes the split-K workspace
    cp.cuda.Device().synchronize()      # default-stream work is not ordered before the non-blocking stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        gemm_bf16(x_dev, w_dev, out)
        g = s.end_capture()
    for i in range(2):                  # new inputs written into the static buffer, then replay
        xb, x = rand_bf16(rng, (T, K))
        with s:         # the copy, the poison and the replay in one stream order
            x_dev.set(xb)
            out.fill(0xFFFF)
            g.launch(s)
        s.synchronize()
        assert rel_err(f64(out), x @ w.T) < BF16_TOL


def test_gemm_bad_args():
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    with pytest.raises(ValueError, match="K"):
        gemm_bf16(cp.zeros((4, 96), np.uint16), cp.zeros((64, 96), np.uint16))
    with pytest.raises(ValueError, match="w"):
        gemm_bf16(cp.zeros((4, 128), np.uint16), cp.zeros((64, 64), np.uint16))
    with pytest.raises(ValueError, match="tokens"):
        gemm_bf16(cp.zeros((161, 128), np.uint16), cp.zeros((64, 128), np.uint16))
    with pytest.raises(ValueError, match="x"):
        gemm_bf16(cp.zeros((4, 128), np.float32), cp.zeros((64, 128), np.uint16))


# ---- both kernels at the engine's decode shapes (gemm.set_variant forces one) ----------------------------
ENGINE = [  # (name, N, K, batch, fp32 out): one TP=8 rank's GEMMs (bench/kernels.py GEMMS, lm_head aside)
    ("q_a+kv_a", 2112, 7168, 1, False), ("q_b", 1536, 1536, 1, False), ("W_UK^T", 512, 128, 8, False),
    ("W_UV", 128, 512, 8, False), ("o_proj", 7168, 1024, 1, False), ("dense gate+up", 4608, 7168, 1, False),
    ("dense down", 7168, 2304, 1, False), ("shared gate+up", 512, 7168, 1, False),
    ("shared down", 7168, 256, 1, False), ("router", 384, 7168, 1, True), ("drafter qkv", 1280, 7168, 1, False),
]
DECODE_T = (1, 2, 5, 8, 13, 16)


@pytest.fixture(params=["splitk", "decode"])
def variant(request, monkeypatch):
    """Forces one kernel; yields (variant, names of the kernels launched since)."""
    from ddtree_cupy.kernels import gemm
    launched = record_kernels(monkeypatch, gemm)
    old = gemm.set_variant(request.param)
    yield request.param, launched
    gemm.set_variant(old)


def _assert_kernel(variant, launched):
    v, names = variant, launched
    used = {"decode" if n.startswith("gemm_bf16_kernel_decode") else "wide" if n.startswith("gemm_bf16_kernel_wide")
            else "splitk" for n in names if n.startswith("gemm_bf16_kernel")}
    assert used == {v}, (v, names)


@pytest.mark.parametrize("T", DECODE_T)
@pytest.mark.parametrize("name,N,K,B,f32", ENGINE, ids=[e[0] for e in ENGINE])
def test_engine_shapes_both_kernels(variant, name, N, K, B, f32, T):
    """Every engine shape through the forced kernel; odd T use strided x / out views (batched shapes always:
    per-head slices of [T, heads, width] rows), and the padding around a view must stay poisoned."""
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    v, launched = variant
    rng = np.random.default_rng(T * 1009 + N + K + (v == "decode"))
    w_dev, w = _weight(N, K, B)
    dt = np.float32 if f32 else np.uint16
    strided = B > 1 or T % 2 == 1
    xb, x = rand_bf16(rng, (B, T, K))
    x_dev, out, obuf = gemm_views(cp, rng, xb, N, dt, strided)
    if B == 1:
        x_dev, out = x_dev[0], out[0]
    gemm_bf16(x_dev, w_dev if B > 1 else w_dev[0], out, out_dtype=dt)
    _assert_kernel(v, launched)
    check_gemm(out, obuf, np.matmul(x, w.transpose(0, 2, 1)), f32, T, N, B)   # BLAS: einsum takes seconds here


@pytest.mark.parametrize("T,N,K,f32", [(8, 2112, 7168, False), (13, 384, 7168, True), (16, 7168, 1024, False)])
def test_engine_graph_replay_equals_eager(variant, T, N, K, f32):
    """Captured once, replayed with new inputs written into the static buffer: bit-identical to an eager
    call on the same inputs (both kernels are deterministic), and right against float64."""
    v, launched = variant
    rng = np.random.default_rng(T + N)
    w_dev, w = _weight(N, K, 1)
    _graph_replay_equals_eager(w_dev[0], w[0], T, np.float32 if f32 else np.uint16, rng, rounds=3)
    _assert_kernel(v, launched)


def _graph_replay_equals_eager(w_dev, w, T, dt, rng, rounds):
    """x [T, K] @ w: one eager call into a poisoned out, then the call captured on a non-blocking stream and
    replayed ``rounds`` times with new inputs written into the static x, each replay bit-identical to an eager
    call on the same inputs and right against float64 (``w``: the weight's float64 values)."""
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    f32 = np.dtype(dt) == np.float32
    N, K = w.shape
    x_dev, out, eager = cp.empty((T, K), np.uint16), poisoned(cp, (T, N), dt), cp.empty((T, N), dt)
    x_dev[:] = cp.asarray(rand_bf16(rng, (T, K))[0])
    gemm_bf16(x_dev, w_dev, out, out_dtype=dt)
    cp.cuda.Device().synchronize()      # default-stream work is not ordered before the non-blocking stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        gemm_bf16(x_dev, w_dev, out, out_dtype=dt)
        g = s.end_capture()
    for _ in range(rounds):
        xb, x = rand_bf16(rng, (T, K))
        with s:
            x_dev.set(xb)
            out.fill(np.nan if f32 else 0xFFFF)
            g.launch(s)
            gemm_bf16(x_dev, w_dev, eager, out_dtype=dt)
        s.synchronize()
        assert cp.array_equal(out, eager)
        got = out.get().astype(np.float64) if f32 else f64(out)
        assert rel_err(got, x @ w.T) < (1e-5 if f32 else BF16_TOL)


@pytest.mark.parametrize("v,T", [("splitk", 1), ("splitk", 16), ("decode", 1), ("decode", 16), ("wide", 32),
                                 ("wide", 160)])
def test_engine_pdl_chain_equals_plain(monkeypatch, v, T):
    """q_a -> q_b (strided input) -> gate+up -> down (strided input) -> router+shared (fp32), each GEMM reading
    the one before, 3 rounds of new inputs, every GEMM on the forced family: with PDL (eager and graph replay,
    intermediates poisoned between replays) bit-identical to plain launches; the first stage against float64;
    every launch went through the PDL path (sm_90+)."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm, launch
    launched = record_kernels(monkeypatch, gemm)
    rng = np.random.default_rng(77 + T)
    ws = {k: _weight(*s, 1) for k, s in dict(qa=(2112, 7168), qb=(7168, 1536), gu=(4608, 7168),
                                             dn=(7168, 2304), rt=(896, 7168)).items()}
    xs = [rand_bf16(rng, (T, 7168)) for _ in range(3)]
    x_dev = cp.asarray(np.stack([b for b, _ in xs]))
    mid = dict(qa=cp.empty((T, 2112), np.uint16), qb=cp.empty((T, 7168), np.uint16),
               gu=cp.empty((T, 4608), np.uint16), dn=cp.empty((T, 7168), np.uint16))

    def chain(lg):
        for r in range(3):
            gemm.gemm_bf16(x_dev[r], ws["qa"][0][0], mid["qa"])
            gemm.gemm_bf16(mid["qa"][:, :1536], ws["qb"][0][0], mid["qb"])
            gemm.gemm_bf16(mid["qb"], ws["gu"][0][0], mid["gu"])
            gemm.gemm_bf16(mid["gu"][:, :2304], ws["dn"][0][0], mid["dn"])
            gemm.gemm_bf16(mid["dn"], ws["rt"][0][0], lg[r], out_dtype=np.float32)

    n_pdl = [0]
    real = launch.launch_pdl

    def counting(*a, **k):
        n_pdl[0] += 1
        return real(*a, **k)
    launch.launch_pdl = counting
    old = gemm.set_variant(v)
    s = cp.cuda.Stream(non_blocking=True)
    try:
        ref = cp.full((3, T, 896), np.nan, np.float32)
        cp.cuda.Device().synchronize()      # the fills above ran on the default stream
        launch.set_pdl(False)
        with s:
            chain(ref)
        s.synchronize()
        first = f64(mid["qa"])      # round 2's q_a output, against float64
        assert rel_err(first, xs[2][1] @ ws["qa"][1][0].T) < BF16_TOL
        assert np.all(np.isfinite(ref.get()))
        launch.set_pdl(True)
        with s:
            got = cp.full((3, T, 896), np.nan, np.float32)
            chain(got)
        s.synchronize()
        assert cp.array_equal(got, ref)
        with s:
            s.begin_capture()
            chain(got)
            g = s.end_capture()
        for _ in range(2):
            with s:
                got.fill(np.nan)
                for m in mid.values():
                    m.fill(0xFFFF)      # a consumer reading before its producer finished would see NaN
                g.launch(s)
            s.synchronize()
            assert cp.array_equal(got, ref)
    finally:
        launch.set_pdl(False)
        launch.launch_pdl = real
        gemm.set_variant(old)
    _assert_kernel(v, launched)
    if int(cp.cuda.Device().compute_capability) >= 90:
        assert n_pdl[0] >= 2 * 15, n_pdl      # eager + capture, 15 GEMM launches each (plus split-K reduces)


# ---- every decode config, forced (the selection can pick any of them) ----------------------------
def _run_forced(monkeypatch, variant, setter, cfg, T, N, K, B, f32, rng, strided):
    """Two calls with ``cfg`` forced (the second into a re-poisoned output): the same bits, right against
    float64 per token and per 16-feature block, nothing written outside a strided output view, and the
    launched kernel is the forced config's."""
    import cupy as cp
    from ddtree_cupy.kernels import gemm
    launched = record_kernels(monkeypatch, gemm)
    dt = np.float32 if f32 else np.uint16
    xb, x = rand_bf16(rng, (B, T, K))
    wb, w = rand_bf16(rng, (B, N, K), 0.05)
    w_dev = cp.asarray(wb)
    x_dev, out, obuf = gemm_views(cp, rng, xb, N, dt, strided)
    if B == 1:
        x_dev, out, w_dev = x_dev[0], out[0], w_dev[0]
    old, old_v = setter(cfg), gemm.set_variant(variant)
    try:
        first = gemm_twice(x_dev, w_dev, out, dt)
    finally:
        setter(old)
        gemm.set_variant(old_v)
    assert launched == [cfg.name(f32)] * 2, launched
    assert cp.array_equal(first, out), "repeat differs: the summation order must be fixed"
    check_gemm(out, obuf, np.matmul(x, w.transpose(0, 2, 1)), f32, T, N, B)


def _dec_cases():
    from ddtree_cupy.kernels.gemm import DEC_CONFIGS
    out = []
    for c in DEC_CONFIGS:
        Ts = (1, 5, 8) if c.nt == 1 else (9, 13, 16)
        rows = 16 * c.rt
        # K: 7168 (long slices), 576 (9 k tiles: uneven slices, and with CS = 4 / RT = 4 blocks or warps
        # with 1-2 tiles), 128 (fewer tiles than warps / cluster blocks: empty slices)
        shapes = [(rows * 5, 7168, 1), (rows * 3, 576, 2), (rows, 128, 1)]
        for i, (N, K, B) in enumerate(shapes):
            out.append((c, Ts[i % 3], N, K, B, i == 1))
    return out


@pytest.mark.parametrize("cfg,T,N,K,B,f32", _dec_cases(), ids=lambda v: str(tuple(v)) if isinstance(v, tuple) else str(v))
def test_every_decode_config(monkeypatch, cfg, T, N, K, B, f32):
    from ddtree_cupy.kernels import gemm
    rng = np.random.default_rng(hash((tuple(cfg), T, N, K)) % 2**32)
    _run_forced(monkeypatch, "decode", gemm.set_decode_config, cfg, T, N, K, B, f32, rng, strided=(T % 2 == 1 or B > 1))


@pytest.mark.parametrize("T,N,K,f32", [(1, 1280, 7168, False), (16, 384, 7168, True), (16, 7168, 1024, False),
                                       (1, 4608, 7168, False), (16, 4608, 7168, False), (8, 7168, 256, False),
                                       (17, 2112, 7168, False), (160, 2112, 7168, False), (64, 896, 7168, True),
                                       (160, 7168, 2304, False)])
def test_auto_pick_graph_replay_equals_eager(T, N, K, f32):
    """The rule's own pick (cluster, RT, light-ring configs at T <= 16; the wide-token kernel with its split,
    fp32 out included, above) captured once and replayed with new inputs: bit-identical to an eager call, right
    against float64, with PDL on as the engine runs it."""
    import cupy as cp
    from ddtree_cupy.kernels import launch
    rng = np.random.default_rng(T * 3 + N)
    wb, w = rand_bf16(rng, (N, K), 0.05)
    w_dev = cp.asarray(wb)
    launch.set_pdl(True)
    try:
        _graph_replay_equals_eager(w_dev, w, T, np.float32 if f32 else np.uint16, rng, rounds=2)
    finally:
        launch.set_pdl(False)
