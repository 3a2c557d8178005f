"""Skinny bf16 GEMM (cuda_src/gemm_bf16.cu): y[T, N] = x[T, K] @ W[N, K]^T, fp32 accumulate.

Decode shapes: T = 1..160 tokens, K 64..7168, N 16..20480. The weight is streamed once; split-K spreads a
narrow weight over every SM. Optional batch dimension (per-head products): x [B, T, K], w [B, N, K],
out [B, T, N]; x and out may be strided views (inner dimension contiguous, 16-byte aligned rows).
Two kernels serve a call, chosen by ``use_decode`` (a rule per T and shape, overridable with ``set_variant``):
 * "splitk": ``gemm_bf16_kernel`` (64 weight rows per block, split-K across blocks, fp32 partials in a
   workspace summed by ``gemm_splitk_reduce``, a second launch); every T <= 160;
 * "decode": ``gemm_bf16_kernel_decode`` (T <= 16: 16 weight rows per block, K split across the block's
   8 warps and reduced in shared memory: one launch, no workspace).
Every kernel obeys the PDL rule (``pdl=True``): with ``launch.set_pdl(True)`` they launch through
cuLaunchKernelEx with programmatic dependent launch (kernels/launch.py).
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


# Decode variant: 16 weight rows per block, DEC_WARPS warps each with its own ring of (16 + 8 NT) rows x BK.
DEC_ROWS, DEC_WARPS = 16, 8
DEC_THREADS = 32 * DEC_WARPS
DEC_MAX_T = 16
DEC_NT = (1, 2)


def dec_stages(nt: int) -> int:
    """Ring depth per warp: as many stages (<= 6) as fit the shared-memory budget (NT 1: 4, NT 2: 3)."""
    return min(6, SMEM_BUDGET // (DEC_WARPS * (DEC_ROWS + 8 * nt) * BK * 2))


def dec_smem_bytes(nt: int) -> int:
    return DEC_WARPS * dec_stages(nt) * (DEC_ROWS + 8 * nt) * BK * 2


def _dec_name(nt: int, out_f32: bool) -> str:
    return f"gemm_bf16_kernel_decode<{nt}, {dec_stages(nt)}, {'true' if out_f32 else 'false'}>"


SPEC = register(KernelSpec(
    src="gemm_bf16.cu",
    names=tuple(_name(nt, f) for f in (False, True) for nt in NT_CHOICES)
    + tuple(_dec_name(nt, f) for f in (False, True) for nt in DEC_NT)
    + ("gemm_splitk_reduce<false>", "gemm_splitk_reduce<true>"),
    hot=True, pdl=True,      # every kernel waits (DDT_PDL_WAIT) before reading activations or writing
    doc="skinny bf16 GEMM, mma.sync m16n8k16 + ldmatrix + cp.async ring, split-K or in-block K split"))

VARIANTS = ("auto", "splitk", "decode")
_VARIANT = ["auto"]
# The rule (docs/KERNELS.md "Decode variant"), from the H200 run of this kernel (bench/results/
# gemm_decode_h200.json, PDL on as the engine runs): the decode kernel won at every engine shape for T <= 8;
# at T = 9..16 (two token tiles, 3-stage rings) it lost only where its grid is tiny (router: 24 blocks; the
# 32-block shared gate+up still won) or just past one wave of resident blocks (gate+up: 288 blocks in 264).
DECODE_BY_DEFAULT = True          # False: "auto" always picks split-K
DECODE_MIN_BLOCKS_PER_SM = 0.2    # T > 8: fewer blocks than this x SMs -> split-K
DECODE_TAIL_WAVES = (1.0, 1.25)   # T > 8: waves of resident blocks in (lo, hi] -> split-K


def set_variant(variant: str) -> str:
    """Force a kernel for every call ("splitk" / "decode"), or back to the rule ("auto"); returns the old
    setting. "decode" still falls back to split-K where it cannot serve (T > 16, explicit ``split_k``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: one of {VARIANTS}, got {variant!r}")
    old, _VARIANT[0] = _VARIANT[0], variant
    return old


def use_decode(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132, slots_per_sm: int = 2) -> bool:
    """The selection rule: the decode kernel for T <= 16 when forced; under "auto" (and DECODE_BY_DEFAULT)
    for T <= 8 always, for T = 9..16 unless the grid of N / 16 x batch blocks is below
    DECODE_MIN_BLOCKS_PER_SM x SMs or ends in a thin second wave (``slots_per_sm`` resident blocks per SM)."""
    if T > DEC_MAX_T or _VARIANT[0] == "splitk":
        return False
    if _VARIANT[0] == "decode":
        return True
    if not DECODE_BY_DEFAULT:
        return False
    if T <= 8:
        return True
    blocks = (N // DEC_ROWS) * batch
    waves = blocks / (slots_per_sm * sm_count)
    lo, hi = DECODE_TAIL_WAVES
    return blocks >= DECODE_MIN_BLOCKS_PER_SM * sm_count and not lo < waves <= hi


_SM_COUNT = {}
_DEC_SLOTS = {}
_WORKSPACE = {}


def _sm_count() -> int:
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return _SM_COUNT[dev]


def _dec_slots_per_sm() -> int:
    """Resident decode blocks per SM by shared memory (H200 228 KB: 2; sm_120 ~100 KB: 1); 2 if unknown."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _DEC_SLOTS:
        per_sm = cupy.cuda.Device().attributes.get("MaxSharedMemoryPerMultiprocessor", 0)
        _DEC_SLOTS[dev] = max(1, per_sm // (dec_smem_bytes(2) + 1024)) if per_sm else 2
    return _DEC_SLOTS[dev]


def choose_split(T: int, N: int, K: int, batch: int = 1, sm_count: int = 132) -> int:
    """Split-K factor: enough blocks for ~4 per SM, but fp32 partials at most ~25% of the weight bytes."""
    k_tiles = K // BK
    col_blocks = math.ceil(N / BN) * batch
    want = math.ceil(4 * sm_count / col_blocks)
    cap = max(1, min(k_tiles, K // (8 * T)))
    split = max(1, min(want, cap))
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


def gemm_bf16(x, w, out=None, *, out_dtype=np.uint16, split_k: Optional[int] = None, workspace=None):
    """y = x @ w^T. x [T, K] or [B, T, K] bf16 (uint16), w [N, K] or [B, N, K] bf16 (contiguous),
    out [T, N] / [B, T, N] uint16 (bf16) or float32 (``out_dtype``). Returns ``out``.

    Split-K partials go to ``workspace`` (float32, >= B*split*T*N) or a per-device shared buffer (one
    stream at a time; call once before graph capture so it is large enough). Where ``use_decode`` picks the
    decode kernel (never with an explicit ``split_k``), neither a workspace nor a second launch is used.
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
    out_f32 = out_dtype == np.float32
    w_bs = N * K if batched else 0
    if split_k is None and use_decode(T, N, K, B, _sm_count(), _dec_slots_per_sm()):
        nt = 1 if T <= 8 else 2
        smem = dec_smem_bytes(nt)
        kern = get_kernel(SPEC, _dec_name(nt, out_f32), max_dynamic_smem=smem)
        kern((N // DEC_ROWS, 1, B), (DEC_THREADS,),
             (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
              out, np.int32(T), np.int32(N), np.int32(K), np.int32(0)), shared_mem=smem)
        return out
    split = choose_split(T, N, K, B, _sm_count()) if split_k is None else check_range("split_k", split_k, 1, K // BK)
    per = math.ceil(K // BK / split)
    split = math.ceil(K // BK / per)
    nt = next(c for c in NT_CHOICES if 8 * c >= T)
    ws = _workspace(B * split * T * N * 4, workspace) if split > 1 else out
    smem = smem_bytes(nt)
    kern = get_kernel(SPEC, _name(nt, out_f32), max_dynamic_smem=smem)
    kern((math.ceil(N / BN), split, B), (THREADS,),
         (x, np.int64(xs[0]), np.int32(xs[1]), w, np.int64(w_bs), out, np.int64(os_[0]), np.int32(os_[1]),
          ws, np.int32(T), np.int32(N), np.int32(K), np.int32(per)), shared_mem=smem)
    if split > 1:
        red = get_kernel(SPEC, f"gemm_splitk_reduce<{'true' if out_f32 else 'false'}>")
        blocks = min(math.ceil(T * N / 256), 4 * _sm_count())
        red((blocks, B), (256,), (ws, np.int32(split), np.int32(T), np.int32(N), out, np.int64(os_[0]),
                                  np.int32(os_[1])))
    return out
