"""MoE router (noaux_tc, sigmoid): fp32 gate logits by the skinny GEMM, then group-limited top-k
(cuda_src/router.cu).

    ids, weights = route(x [T, H] bf16, gate [E, H] bf16, bias [E] f32, k=8, n_group=1, topk_group=1,
                         routed_scaling_factor=2.827, normalize=True)
ids int32 [T, k] in descending choice order (ties: lower expert id), weights float32 [T, k] from the
UNBIASED sigmoid scores.

``route_logits(..., gate_up=, act_out=)`` also computes the shared expert's activation
act_out [T, I] = bf16(silu(g) * u) with g, u = bf16(gate_up[:, :I]), bf16(gate_up[:, I:]) from the FP32
gate_up [T, 2I] in the same launch (extra blocks): the target issues ONE fp32-output GEMM for the router
and the shared expert's gate+up (weight [E + 2I, H]) and passes its column slices as ``logits`` and
``gate_up``; rounding to bf16 first gives exactly what a bf16-output GEMM + ``silu_mul`` would.
"""
from __future__ import annotations

import numpy as np

from .checks import check_array, check_range, check_rows
from .compile import KernelSpec, get_kernel, register
from .gemm import gemm_bf16

SPEC = register(KernelSpec("router.cu", ("router_topk",), hot=True, pdl=True,
                           doc="noaux_tc group-limited top-k (+ the shared expert's silu_mul)"))
MAX_E = 512
WARPS = 4          # tokens per block (one warp each)


def _ptr(a):
    """A pointer argument: the array, or a real NULL (CuPy turns None into 0xffffffff, cupy/cupy#9046)."""
    return np.uint64(0) if a is None else a


def route_logits(logits, bias, k: int, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 normalize: bool = True, out_ids=None, out_weights=None, *, gate_up=None, act_out=None):
    """Selection from precomputed fp32 logits [T, E] (row-strided view allowed); with ``gate_up`` [T, 2I]
    float32 (row-strided view, 16-byte aligned) also ``act_out`` [T, I] bf16 = silu(gate) * up in the same
    launch."""
    import cupy
    dims = {}
    ls = check_rows("logits", logits, np.float32, ("T", "E"), dims, align=4)
    check_array("bias", bias, np.float32, ("E",), dims)
    T, E = dims["T"], dims["E"]
    check_range("E (logits.shape[1])", E, 1, MAX_E)
    check_range("n_group", n_group, 1, min(32, E))
    if E % n_group:
        raise ValueError(f"n_group: {n_group} does not divide the expert count {E}")
    check_range("topk_group", topk_group, 1, n_group)
    check_range("k", k, 1, min(32, topk_group * (E // n_group)))
    if out_ids is None:
        out_ids = cupy.empty((T, k), dtype=np.int32)
    if out_weights is None:
        out_weights = cupy.empty((T, k), dtype=np.float32)
    check_array("out_ids", out_ids, np.int32, (T, k))
    check_array("out_weights", out_weights, np.float32, (T, k))
    gs = os_ = (0,)
    I = act_blocks = 0
    if gate_up is not None:
        if act_out is None:
            raise ValueError("act_out: required with gate_up")
        gs = check_rows("gate_up", gate_up, np.float32, ("T", None), dims)
        if gate_up.shape[1] % 16:
            raise ValueError(f"gate_up: width must be 2I with I a multiple of 8, got {gate_up.shape[1]}")
        I = gate_up.shape[1] // 2
        os_ = check_rows("act_out", act_out, np.uint16, ("T", I), dims)
        # 8 values per thread step (2 x 32 B of fp32 in, 16 B out); the SwiGLU blocks loop grid-stride, so
        # the cap only bounds the grid
        act_blocks = max(1, min(512, -(-T * I // 8 // (32 * WARPS))))
    elif act_out is not None:
        raise ValueError("act_out: given without gate_up")
    if T:
        route_blocks = (T + WARPS - 1) // WARPS
        kern = get_kernel(SPEC, "router_topk")
        kern((route_blocks + act_blocks,), (32 * WARPS,),
             (logits, np.int64(ls[0]), np.int32(T), np.int32(E), bias, np.int32(n_group), np.int32(topk_group), np.int32(k),
              np.int32(1 if normalize else 0), np.float32(routed_scaling_factor), out_ids, out_weights,
              np.int32(route_blocks), _ptr(gate_up), np.int64(gs[0]), _ptr(act_out), np.int64(os_[0]),
              np.int32(I)))
    return out_ids, out_weights


def route(x, gate, bias, k: int, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          normalize: bool = True, out_ids=None, out_weights=None, logits=None):
    """x [T, H] bf16 @ gate [E, H]^T in fp32 (``logits`` float32 [T, E] scratch), then ``route_logits``."""
    import cupy
    dims = {}
    check_array("x", x, np.uint16, ("T", "H"), dims)
    check_array("gate", gate, np.uint16, ("E", "H"), dims)
    if logits is None:
        logits = cupy.empty((dims["T"], dims["E"]), dtype=np.float32)
    gemm_bf16(x, gate, logits, out_dtype=np.float32)
    return route_logits(logits, bias, k, n_group, topk_group, routed_scaling_factor, normalize, out_ids, out_weights)
