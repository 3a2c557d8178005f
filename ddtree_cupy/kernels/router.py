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

``route_logits(..., gate_up=, down_w=, down_out=)`` (``router_topk_down``) goes one step further: the
extra blocks compute the shared expert's down projection down_out [T, H] = act @ down_w^T (down_w bf16
[H, I]) with act formed on the fly (the same bf16 values as above), so the shared down GEMM's launch goes
away. ``shared_down_fused(T, I, H)`` is the rule the target uses to pick it (T <= DOWN_MAX_T and I in 64/128/256;
env DDT_ROUTER_DOWN=0 falls back to route + SwiGLU and a separate gemm_bf16, =1 forces it where the
shapes allow).
"""
from __future__ import annotations

import os

import numpy as np

from .. import knobs
from .checks import check_array, check_range, check_rows
from .compile import KernelSpec, get_kernel, register
from .gemm import gemm_bf16

DOWN_KS = (1, 2, 4)      # router_topk_down<KS>: shared intermediate I = 64 KS (Kimi TP8 rank: 256)
_NAMES = ("router_topk",) + tuple(f"router_topk_down<{ks}>" for ks in DOWN_KS)
SPEC = register(KernelSpec("router.cu", _NAMES, hot=True, pdl=True,
                           doc="noaux_tc group-limited top-k (+ the shared expert's silu_mul, or its whole "
                               "SwiGLU + down projection)"))
MAX_E = 512
WARPS = 4          # tokens per block (one warp each)
DOWN_MAX_T = 32    # the rule's limit (each column block recomputes its tile's SwiGLU, see router.cu): on the
                   # H200 the fused launch beat route + SwiGLU then gemm_bf16 at T = 1 / 8 / 32 by 2.1 / 2.1 / 0.4 us
                   # per layer and lost at 64 by ~1.7 us (the 2026-11 integration run, docs/MODELS.md)
DOWN_TILE = 16


def shared_down_fused(T: int, I: int, H: int) -> bool:
    """Whether the target runs the shared expert's down projection inside the route launch
    (``route_logits(down_w=)``) for T rows, shared intermediate I and hidden size H. Env DDT_ROUTER_DOWN:
    0 never (the previous variant: route + SwiGLU, then gemm_bf16), 1 whenever the shapes allow, unset
    the rule T <= DOWN_MAX_T (read at every call, so a process may flip it between graph captures)."""
    mode = knobs.get().router_down
    if mode is False or I % 64 or I // 64 not in DOWN_KS or H % 32:
        return False
    return mode is True or T <= DOWN_MAX_T


def _ptr(a):
    """A pointer argument: the array, or a real NULL (CuPy turns None into 0xffffffff, cupy/cupy#9046)."""
    return np.uint64(0) if a is None else a


def route_logits(logits, bias, k: int, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 normalize: bool = True, out_ids=None, out_weights=None, *, gate_up=None, act_out=None,
                 down_w=None, down_out=None, row_pos=None):
    """Selection from precomputed fp32 logits [T, E] (row-strided view allowed); with ``gate_up`` [T, 2I]
    float32 (row-strided view, 16-byte aligned) also ``act_out`` [T, I] bf16 = silu(gate) * up in the same
    launch; or instead of act_out, ``down_w`` bf16 [H, I] (contiguous, I = 64 / 128 / 256) and ``down_out``
    bf16 [T, H] (row-strided view allowed): down_out = act @ down_w^T in the same launch.
    ``row_pos`` int32 [T] (the batch's kv_pos): rows with row_pos < 0 are padding and select no expert
    (ids -1, weights 0; the MoE skips them); the other rows' selection is unchanged."""
    import cupy
    dims = {}
    ls = check_rows("logits", logits, np.float32, ("T", "E"), dims, align=4)
    check_array("bias", bias, np.float32, ("E",), dims)
    T, E = dims["T"], dims["E"]
    if row_pos is not None:
        check_array("row_pos", row_pos, np.int32, ("T",), dims)
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
    if down_w is not None or down_out is not None:
        return _route_down(logits, ls, bias, T, E, k, n_group, topk_group, routed_scaling_factor, normalize,
                           out_ids, out_weights, gate_up, act_out, down_w, down_out, row_pos)
    if gate_up is not None:
        if act_out is None:
            raise ValueError("act_out: required with gate_up (or down_w / down_out)")
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
              np.int32(I), _ptr(row_pos)))
    return out_ids, out_weights


def _route_down(logits, ls, bias, T, E, k, n_group, topk_group, scale, normalize, out_ids, out_weights, gate_up,
                act_out, down_w, down_out, row_pos=None):
    """route_logits' router_topk_down launch (arguments already checked up to gate_up)."""
    if down_w is None or down_out is None:
        raise ValueError("down_w / down_out: give both (the shared down projection's weight and output)")
    if gate_up is None:
        raise ValueError("gate_up: required with down_w (the fp32 shared gate|up columns)")
    if act_out is not None:
        raise ValueError("act_out: not produced by the fused down path (give act_out OR down_w / down_out)")
    dims = {"T": T}
    gs = check_rows("gate_up", gate_up, np.float32, ("T", "2I"), dims)
    I = dims["2I"] // 2
    if dims["2I"] % 2 or I % 64 or I // 64 not in DOWN_KS:
        raise ValueError(f"gate_up: width must be 2I with I in {[64 * ks for ks in DOWN_KS]} for down_w, "
                         f"got {dims['2I']}")
    check_array("down_w", down_w, np.uint16, ("H", I), dims)
    H = dims["H"]
    if H % 32:
        raise ValueError(f"down_w: the output width H = {H} must be a multiple of 32")
    if down_w.data.ptr % 16:
        raise ValueError("down_w: base address must be 16-byte aligned")
    os_ = check_rows("down_out", down_out, np.uint16, ("T", "H"), dims, align=2)
    if T:
        route_blocks = (T + WARPS - 1) // WARPS
        col_blocks = H // 32
        zgroups = -(-T // DOWN_TILE)            # one token tile per block up to DOWN_MAX_T rows, then loops
        zgroups = min(zgroups, DOWN_MAX_T // DOWN_TILE)
        kern = get_kernel(SPEC, f"router_topk_down<{I // 64}>")
        kern((route_blocks + col_blocks * zgroups,), (32 * WARPS,),
             (logits, np.int64(ls[0]), np.int32(T), np.int32(E), bias, np.int32(n_group), np.int32(topk_group),
              np.int32(k), np.int32(1 if normalize else 0), np.float32(scale), out_ids, out_weights,
              np.int32(route_blocks), gate_up, np.int64(gs[0]), down_w, down_out, np.int64(os_[0]), np.int32(H),
              np.int32(col_blocks), _ptr(row_pos)))
    return out_ids, out_weights


def route(x, gate, bias, k: int, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          normalize: bool = True, out_ids=None, out_weights=None, logits=None, row_pos=None):
    """x [T, H] bf16 @ gate [E, H]^T in fp32 (``logits`` float32 [T, E] scratch), then ``route_logits``
    (``row_pos``: padding rows select no expert)."""
    import cupy
    dims = {}
    check_array("x", x, np.uint16, ("T", "H"), dims)
    check_array("gate", gate, np.uint16, ("E", "H"), dims)
    if logits is None:
        logits = cupy.empty((dims["T"], dims["E"]), dtype=np.float32)
    gemm_bf16(x, gate, logits, out_dtype=np.float32)
    return route_logits(logits, bias, k, n_group, topk_group, routed_scaling_factor, normalize, out_ids, out_weights,
                        row_pos=row_pos)
