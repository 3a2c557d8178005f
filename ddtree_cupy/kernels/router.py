"""MoE router (noaux_tc, sigmoid): fp32 gate logits by the skinny GEMM, then group-limited top-k
(cuda_src/router.cu).

    ids, weights = route(x [T, H] bf16, gate [E, H] bf16, bias [E] f32, k=8, n_group=1, topk_group=1,
                         routed_scaling_factor=2.827, normalize=True)
ids int32 [T, k] in descending choice order (ties: lower expert id), weights float32 [T, k] from the
UNBIASED sigmoid scores.
"""
from __future__ import annotations

import numpy as np

from .checks import check_array, check_range
from .compile import KernelSpec, get_kernel, register
from .gemm import gemm_bf16

SPEC = register(KernelSpec("router.cu", ("router_topk",), hot=True, doc="noaux_tc group-limited top-k"))
MAX_E = 512
WARPS = 4          # tokens per block (one warp each)


def route_logits(logits, bias, k: int, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 normalize: bool = True, out_ids=None, out_weights=None):
    """Selection from precomputed fp32 logits [T, E]."""
    import cupy
    dims = {}
    check_array("logits", logits, np.float32, ("T", "E"), dims)
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
    if T:
        kern = get_kernel(SPEC, "router_topk")
        kern(((T + WARPS - 1) // WARPS,), (32 * WARPS,),
             (logits, np.int32(T), np.int32(E), bias, np.int32(n_group), np.int32(topk_group), np.int32(k),
              np.int32(1 if normalize else 0), np.float32(routed_scaling_factor), out_ids, out_weights))
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
