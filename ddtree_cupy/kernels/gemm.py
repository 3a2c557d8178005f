"""Skinny bf16 GEMM (cuda_src/gemm_bf16.cu): y[T, N] = x[T, K] @ W[N, K]^T, fp32 accumulate.

Decode shapes: T = 1..160 tokens, K 64..7168, N 16..20480. The weight is streamed once; split-K spreads a
narrow weight over every SM, and the last block of each column tile sums the partials (no reduction launch;
per-tile tickets in a small zeroed int32 buffer that resets itself). The kernel obeys the PDL rule
(``pdl=True``): with ``launch.set_pdl(True)`` its weight prefetch overlaps the previous kernel. Optional batch dimension (per-head products): x [B, T, K], w [B, N, K],
out [B, T, N]; x and out may be strided views (inner dimension contiguous, 16-byte aligned rows).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .checks import check_array, check_multiple, check_range, check_rows
from .compile import KernelSpec, get_kernel, register

BN, BK, THREADS = 64, 64, 128
MAX_T = 160
NT_CHOICES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20)     # token tiles of 8 compiled; T rounds up to one
SMEM_BUDGET = 96 * 1024                              # below sm_120's 99 KB per block


def stages_for(nt: int) -> int:
    """Pipeline depth: as many stages (<= 6) as fit the shared-memory budget."""
    return min(6, SMEM_BUDGET // ((BN + nt * 8) * BK * 2))


def smem_bytes(nt: int) -> int:
    return stages_for(nt) * (BN + nt * 8) * BK * 2


def _name(nt: int, out_f32: bool) -> str:
    return f"gemm_bf16_kernel<{nt}, {stages_for(nt)}, {'true' if out_f32 else 'false'}>"


SPEC = register(KernelSpec(
    src="gemm_bf16.cu",
    names=tuple(_name(nt, f) for f in (False, True) for nt in NT_CHOICES),
    hot=True, pdl=True,
    doc="skinny bf16 GEMM, mma.sync m16n8k16 + ldmatrix + cp.async ring, split-K reduced in the kernel"))

_SM_COUNT = {}
_WORKSPACE = {}
_TICKETS = {}       # (device, workspace pointer) -> zeroed int32 tickets, one per (batch, column tile)


def _sm_count() -> int:
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM_COUNT[dev]


def _balance(k_tiles: int, col_blocks: int, split: int, sm_count: int) -> float:
    """Useful k-tiles / (SMs x k-tiles of the busiest SM) when the blocks are dealt evenly over the SMs."""
    per = math.ceil(k_tiles / split)
    blocks = col_blocks * math.ceil(k_tiles / per)
    return col_blocks * k_tiles / (sm_count * math.ceil(blocks / sm_count) * per)


def choose_split(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132) -> int:
    """Split-K factor. Up to ~4 blocks per SM (bytes in flight), fp32 partials at most ~25% of the weight
    bytes, and among those the split whose blocks spread most evenly over the SMs (a 1.09-wave grid costs
    a second wave: gate+up's 8 x 72 blocks on 132 SMs), the largest one within 2% of the best."""
    k_tiles = K // BK
    col_blocks = math.ceil(N / BN) * batch
    want = math.ceil(4 * sm_count / col_blocks)
    cap = max(1, min(k_tiles, K // (8 * T)))
    top = max(1, min(want, cap))
    score = {s: _balance(k_tiles, col_blocks, s, sm_count) for s in range(1, top + 1)}
    best = max(score.values())
    split = max(s for s, v in score.items() if v >= best - 0.02)
    per = math.ceil(k_tiles / split)
    return math.ceil(k_tiles / per)       # no empty splits


def _workspace(nbytes: int, workspace):
    import cupy
    if workspace is not None:
        check_array("workspace", workspace, np.float32, (None,))
        if workspace.nbytes < nbytes:
            raise ValueError(f"workspace: needs {nbytes} bytes, got {workspace.nbytes}")
        return workspace
    dev = cupy.cuda.Device().id
    ws = _WORKSPACE.get(dev)
    if ws is None or ws.nbytes < nbytes:
        stream = cupy.cuda.get_current_stream()
        if getattr(stream, "is_capturing", lambda: False)():
            raise ValueError("workspace: the shared split-K workspace must grow, which cannot happen during "
                             "graph capture; run the same GEMM once before capturing or pass workspace=")
        ws = cupy.empty(max(nbytes // 4, 1 << 20), dtype=np.float32)
        _WORKSPACE[dev] = ws
    return ws


def _tickets(ws, count: int):
    """The zeroed ticket counters that go with workspace ``ws`` (allocated on first use, never during capture:
    each grid leaves them zero again)."""
    import cupy
    key = (cupy.cuda.Device().id, ws.data.ptr)
    t = _TICKETS.get(key)
    if t is None or t.size < count:
        stream = cupy.cuda.get_current_stream()
        if getattr(stream, "is_capturing", lambda: False)():
            raise ValueError("workspace: the split-K tickets for this workspace must be allocated, which cannot "
                             "happen during graph capture; run the same GEMM once before capturing")
        t = cupy.zeros(max(count, 4096), dtype=np.int32)
        _TICKETS[key] = t
    return t


def gemm_bf16(x, w, out=None, *, out_dtype=np.uint16, split_k: Optional[int] = None, workspace=None):
    """y = x @ w^T. x [T, K] or [B, T, K] bf16 (uint16), w [N, K] or [B, N, K] bf16 (contiguous),
    out [T, N] / [B, T, N] uint16 (bf16) or float32 (``out_dtype``). Returns ``out``.

    Split-K partials go to ``workspace`` (float32, >= B*split*T*N) or a per-device shared buffer (one
    stream at a time; call once before graph capture so it is large enough).
    """
    import cupy
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.uint16), np.dtype(np.float32)):
        raise ValueError(f"out_dtype: must be uint16 (bf16) or float32, got {out_dtype}")
    batched = getattr(w, "ndim", 0) == 3
    dims = {}
    if batched:
        xs = check_rows("x", x, np.uint16, ("B", "T", "K"), dims)
        check_array("w", w, np.uint16, ("B", "N", "K"), dims)
    else:
        xs = (0,) + check_rows("x", x, np.uint16, ("T", "K"), dims)
        check_array("w", w, np.uint16, ("N", "K"), dims)
    B = dims.get("B", 1)
    T, N, K = dims["T"], dims["N"], dims["K"]
    check_range("x.shape[-2] (tokens T)", T, 1, MAX_T)
    check_multiple("K (x.shape[-1])", K, BK)
    check_multiple("N (w.shape[-2])", N, 16)
    oshape = (B, T, N) if batched else (T, N)
    if out is None:
        out = cupy.empty(oshape, dtype=out_dtype)
    os_ = check_rows("out", out, out_dtype, oshape, align=out_dtype.itemsize)
    if not batched:
        os_ = (0,) + os_
    split = choose_split(T, N, K, B, _sm_count()) if split_k is None else check_range("split_k", split_k, 1, K // BK)
    per = math.ceil(K // BK / split)
    split = math.ceil(K // BK / per)
    nt = next(c for c in NT_CHOICES if 8 * c >= T)
    out_f32 = out_dtype == np.float32
    cols = math.ceil(N / BN)
    if split > 1:
        ws = _workspace(B * split * T * N * 4, workspace)
        if ws.data.ptr % 16:
            raise ValueError("workspace: must be 16-byte aligned (the reduction reads float4)")
        tickets = _tickets(ws, B * cols)
    else:
        ws, tickets = out, np.uint64(0)       # unused: the kernel writes out directly
    smem = smem_bytes(nt)
    kern = get_kernel(SPEC, _name(nt, out_f32), max_dynamic_smem=smem)
    w_bs = N * K if batched else 0
    kern((cols, split, B), (THREADS,),
         (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
          ws, np.int32(T), np.int32(N), np.int32(K), np.int32(per), tickets), shared_mem=smem)
    return out
