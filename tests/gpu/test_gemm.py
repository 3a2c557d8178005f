"""Skinny bf16 GEMM against float64 numpy: every tile size, split-K on/off, batched strided views,
fp32 output, and replay inside a CUDA graph."""
import numpy as np
import pytest

from _kernel_testutil import BF16_TOL, f64, poisoned, rand_bf16, rel_err

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
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        gemm_bf16(x_dev, w_dev, out)
        g = s.end_capture()
    for i in range(2):                  # new inputs written into the static buffer, then replay
        xb, x = rand_bf16(rng, (T, K))
        x_dev.set(xb)
        out.fill(0xFFFF)
        g.launch(s)
        s.synchronize()
        assert rel_err(f64(out), x @ w.T) < BF16_TOL


def test_gemm_bad_args():
    import cupy as cp
    from ddtree_cupy.kernels.gemm import gemm_bf16
    x = cp.zeros((4, 100), np.uint16)
    with pytest.raises(ValueError, match="K"):
        gemm_bf16(cp.zeros((4, 96), np.uint16), cp.zeros((64, 96), np.uint16))
    with pytest.raises(ValueError, match="w"):
        gemm_bf16(cp.zeros((4, 128), np.uint16), cp.zeros((64, 64), np.uint16))
    with pytest.raises(ValueError, match="tokens"):
        gemm_bf16(cp.zeros((161, 128), np.uint16), cp.zeros((64, 128), np.uint16))
    with pytest.raises(ValueError, match="x"):
        gemm_bf16(cp.zeros((4, 128), np.float32), cp.zeros((64, 128), np.uint16))
