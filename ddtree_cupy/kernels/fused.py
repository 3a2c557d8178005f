"""Fused kernels of the target's MLA block (cuda_src/fused_layer.cu), each replacing a chain of launches:

    mla_qkv_a_post(qkv_a, q_a_norm, kv_a_norm, eps, c_q, positions, inv_freq, amplitude,
                   stream_ids, kv_pos, pool, block_table)
        c_q = rms_norm(qkv_a[:, :ql]); latent row = rms_norm(qkv_a[:, ql:ql+512]) | rope(qkv_a[:, -64:])
        written to the paged cache at kv_pos (< 0: skipped). Bit-identical to rms_norm x 2 + rope +
        kv_write_latent (same arithmetic and reduction order).
    mla_head_gemm(x, w, out, pe=, pe_out=, positions=, inv_freq=, amplitude=)
        out[t, h, :] = x[t, h, :] @ w[h]^T (w [nh, N, K], fp32 accumulate, bf16 out), optionally
        pe_out[t, h] = rope(pe[t, h]) (adjacent pairs) in the same launch: W_UK (q_full = q_lat | rope(q_pe))
        and W_UV of the absorbed MLA.

Both launch on the current CuPy stream, allocate nothing, never synchronise, accept strided views (checked),
and read their weights before DDT_PDL_WAIT() (programmatic dependent launch ready: pdl=True).
"""
from __future__ import annotations

import math

import numpy as np

from .checks import check_array, check_range, check_rows, current_device
from .compile import KernelSpec, get_kernel, register

LATENT, ROPE, ROW, PAGE = 512, 64, 576, 64
HEAD_GEMM_KS = (2, 8)           # K = 64 * KS: W_UK^T (K 128) and W_UV (K 512)
SPEC = register(KernelSpec(
    "fused_layer.cu", ("mla_qkv_a_post",) + tuple(f"mla_head_gemm<{ks}>" for ks in HEAD_GEMM_KS), hot=True,
    pdl=True, doc="MLA fusions: q_a/kv_a norms + k_pe rope + cache write; per-head GEMM (+ q_pe rope)"))
QL_MAX = 8 * 2 * 256            # FL_QMAXV vectors of 8 per thread, 256 threads
_SM = {}


def _ptr(a):
    """A pointer argument: the array, or a real NULL (CuPy turns None into 0xffffffff, cupy/cupy#9046)."""
    return np.uint64(0) if a is None else a


def _sm_count() -> int:
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM:
        _SM[dev] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM[dev]


def mla_qkv_a_post(qkv_a, q_a_norm, kv_a_norm, eps: float, c_q, positions, inv_freq, amplitude: float,
                   stream_ids, kv_pos, pool, block_table):
    """See the module doc. qkv_a uint16 [T, ql + 576] (row-strided view allowed), norms uint16 [ql] / [512],
    c_q uint16 [T, ql] (view allowed), positions / stream_ids / kv_pos int32 [T], inv_freq float32 [32],
    pool uint16 [pages, 64, 576], block_table int32 [S, max_pages]."""
    dims: dict = {}
    dev = current_device()
    qs = check_rows("qkv_a", qkv_a, np.uint16, ("T", None), dims)
    T, W = qkv_a.shape
    ql = W - ROW
    check_range("q_lora (qkv_a.shape[1] - 576)", ql, 8, QL_MAX)
    if ql % 8:
        raise ValueError(f"qkv_a: q_lora = {ql} must be a multiple of 8")
    check_array("q_a_norm", q_a_norm, np.uint16, (ql,))
    check_array("kv_a_norm", kv_a_norm, np.uint16, (LATENT,))
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: must be a positive float, got {eps!r}")
    cs = check_rows("c_q", c_q, np.uint16, ("T", ql), dims)
    for name, a in (("positions", positions), ("stream_ids", stream_ids), ("kv_pos", kv_pos)):
        check_array(name, a, np.int32, ("T",), dims, device=dev)
    check_array("inv_freq", inv_freq, np.float32, (ROPE // 2,))
    check_array("pool", pool, np.uint16, (None, PAGE, ROW), device=dev)
    check_array("block_table", block_table, np.int32, (None, None), device=dev)
    if T == 0:
        return c_q
    fn = get_kernel(SPEC, "mla_qkv_a_post")
    fn((T,), (256,), (qkv_a, np.int64(qs[0]), np.int32(ql), q_a_norm, kv_a_norm, np.float32(eps), c_q,
                      np.int64(cs[0]), positions, inv_freq, np.float32(amplitude), stream_ids, kv_pos, pool,
                      block_table, np.int32(block_table.shape[1])))
    return c_q


def head_gemm_grid(nh: int, N: int, T: int, sm_count: int):
    """(nh, N / 32, token groups): enough blocks for ~8 per SM, each group looping over its 16-token tiles."""
    tiles = math.ceil(T / 16)
    return nh, N // 32, max(1, min(tiles, math.ceil(8 * sm_count / (nh * N // 32))))


def mla_head_gemm(x, w, out, *, pe=None, pe_out=None, positions=None, inv_freq=None, amplitude: float = 1.0):
    """out[t, h, n] = sum_k x[t, h, k] w[h, n, k] for x uint16 [T, nh, K], w uint16 [nh, N, K] (contiguous),
    out uint16 [T, nh, N]; x / out are views with a contiguous last dimension and even strides (32-bit pairs).
    K in {128, 512}, N % 32 == 0. With ``pe`` [T, nh, 2 half] also pe_out = rope(pe) at ``positions`` int32 [T]
    (``inv_freq`` float32 [half], ``amplitude``), adjacent pairs."""
    dims: dict = {}
    xs = check_rows("x", x, np.uint16, ("T", "nh", "K"), dims, align=4)
    check_array("w", w, np.uint16, ("nh", "N", "K"), dims)
    T, nh, K, N = dims["T"], dims["nh"], dims["K"], dims["N"]
    os_ = check_rows("out", out, np.uint16, ("T", "nh", "N"), dims, align=2)
    if K % 64 or K // 64 not in HEAD_GEMM_KS:
        raise ValueError(f"x: K = {K} must be one of {[64 * k for k in HEAD_GEMM_KS]}")
    if N % 32:
        raise ValueError(f"w: N = {N} must be a multiple of 32")
    ps = pos_ = (0, 0)
    half = 0
    if pe is not None:
        ps = check_rows("pe", pe, np.uint16, ("T", "nh", "D"), dims, align=2)
        pos_ = check_rows("pe_out", pe_out, np.uint16, ("T", "nh", "D"), dims, align=2)
        if dims["D"] % 2:
            raise ValueError(f"pe: rotary dimension must be even, got {dims['D']}")
        half = dims["D"] // 2
        check_array("positions", positions, np.int32, ("T",), dims)
        check_array("inv_freq", inv_freq, np.float32, (half,))
    elif pe_out is not None or positions is not None or inv_freq is not None:
        raise ValueError("pe: pe_out / positions / inv_freq given without pe")
    if T == 0:
        return out
    fn = get_kernel(SPEC, f"mla_head_gemm<{K // 64}>")
    fn(head_gemm_grid(nh, N, T, _sm_count()), (128,),
       (x, np.int64(xs[0]), np.int64(xs[1]), w, out, np.int64(os_[0]), np.int64(os_[1]), np.int32(T), np.int32(N),
        _ptr(pe), np.int64(ps[0]), np.int64(ps[1]), _ptr(pe_out), np.int64(pos_[0]), np.int64(pos_[1]),
        _ptr(positions), _ptr(inv_freq), np.float32(amplitude), np.int32(half)))
    return out
