"""Layer kernels: RMSNorm (+ fused residual add), RoPE (adjacent / NeoX, table or inv_freq), SiLU-times-up,
vocab-parallel embedding gather. Sources: cuda_src/{norm,rope,act,embed}.cu.

Every wrapper checks its arguments (ValueError naming the argument), launches on the current CuPy
stream, never synchronises, and accepts preallocated outputs so a sequence of calls can be captured in a
CUDA graph. bf16 tensors are uint16 arrays. Row-strided views are accepted where noted (16-byte aligned
rows, contiguous last dimension).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .checks import check_array, check_multiple, check_range, check_rows
from .compile import KernelSpec, get_kernel, register

# pdl=True: every kernel below starts with DDT_PDL_WAIT() (cuda_src/common.cuh), so may be launched with PDL.
NORM_SPEC = register(KernelSpec("norm.cu", ("rmsnorm_kernel",), hot=True, pdl=True,
                                doc="RMSNorm, fused residual add"))
ROPE_NAMES = tuple(f"rope_kernel<{n}, {t}>" for n in ("false", "true") for t in ("false", "true"))
ROPE_SPEC = register(KernelSpec("rope.cu", ROPE_NAMES + ("head_norm_rope_kernel",), hot=True, pdl=True,
                                doc="YaRN RoPE, adjacent / NeoX pairs; per-head RMSNorm + NeoX RoPE"))
ACT_SPEC = register(KernelSpec("act.cu", ("silu_mul_kernel",), hot=True, pdl=True, doc="silu(gate) * up"))
EMBED_SPEC = register(KernelSpec("embed.cu", ("embed_gather_kernel",), pdl=True, doc="vocab-parallel embedding"))

NORM_MAX_H = 8 * 4 * 256

def _ptr(a):
    """A pointer argument: the array, or a real NULL (CuPy turns None into 0xffffffff, cupy/cupy#9046)."""
    return np.uint64(0) if a is None else a


def _grid(total: int, threads: int = 256, cap: int = 65535) -> int:
    return max(1, min(cap, math.ceil(total / threads)))


def rms_norm(x, weight, eps: float, out=None, *, residual=None, residual_out=None, out_rows=None):
    """out[t] = bf16(weight * h / sqrt(mean(h^2) + eps)), h = x[t] (+ residual[t], rounded to bf16).

    x [T, H] bf16 (row-strided view allowed), weight [H] bf16. With ``residual`` the rounded sum is written
    to ``residual_out`` (default: ``residual`` itself, in place). ``out_rows`` int32 [T] scatters row t to
    ``out[out_rows[t]]`` (``out`` then has any number of rows, e.g. a cache viewed as [pages*64, 576]).
    """
    import cupy
    dims = {}
    xs = check_rows("x", x, np.uint16, ("T", "H"), dims)
    T, H = dims["T"], dims["H"]
    check_array("weight", weight, np.uint16, ("H",), dims)
    check_multiple("H (x.shape[1])", H, 8)
    check_range("H (x.shape[1])", H, 8, NORM_MAX_H)
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: must be a positive float, got {eps!r}")
    if out_rows is not None:
        check_array("out_rows", out_rows, np.int32, ("T",), dims)
        if out is None:
            raise ValueError("out: required with out_rows")
        os_ = check_rows("out", out, np.uint16, (None, "H"), dims)
    else:
        if out is None:
            out = cupy.empty((T, H), dtype=np.uint16)
        os_ = check_rows("out", out, np.uint16, ("T", "H"), dims)
    rs = ros = (0,)
    if residual is not None:
        rs = check_rows("residual", residual, np.uint16, ("T", "H"), dims)
        if residual_out is None:
            residual_out = residual
        ros = check_rows("residual_out", residual_out, np.uint16, ("T", "H"), dims)
    elif residual_out is not None:
        raise ValueError("residual_out: given without residual")
    k = get_kernel(NORM_SPEC, "rmsnorm_kernel")
    k((T,), (256,), (x, np.int64(xs[0]), _ptr(residual), np.int64(rs[0]), _ptr(residual_out), np.int64(ros[0]),
                     weight, out, np.int64(os_[0]), _ptr(out_rows), np.int32(H), np.float32(eps)))
    return out


def rope(x, positions, out=None, *, style: str = "adjacent", cos=None, sin=None, inv_freq=None,
         amplitude: float = 1.0, out_rows=None):
    """Rotate pairs of the last dimension of x [T, heads, D] (or [T, D]) by position.

    style 'adjacent': pairs (2i, 2i+1) (MLA q_pe / k_pe); 'neox': pairs (i, i + D/2) (drafter).
    Frequencies: ``cos``/``sin`` float32 tables [max_pos, D/2] (already scaled by the amplitude), or
    ``inv_freq`` float32 [D/2] and ``amplitude`` (YaRN mscale ratio). positions int32 [T].
    ``out`` defaults to x (in place); ``out_rows`` int32 [T] writes token t to ``out[out_rows[t]]``
    (e.g. rotated k_pe straight into the latent cache rows).
    """
    dims = {}
    squeeze = getattr(x, "ndim", 0) == 2
    if squeeze:
        x = x[:, None, :]
        if out is not None and getattr(out, "ndim", 0) == 2:
            out = out[:, None, :]
    xs = check_rows("x", x, np.uint16, ("T", "heads", "D"), dims, align=2)
    T, heads, D = dims["T"], dims["heads"], dims["D"]
    if D % 2:
        raise ValueError(f"x: rotary dimension must be even, got {D}")
    half = D // 2
    if style not in ("adjacent", "neox"):
        raise ValueError(f"style: must be 'adjacent' or 'neox', got {style!r}")
    check_array("positions", positions, np.int32, ("T",), dims)
    if out is None:
        if out_rows is not None:
            raise ValueError("out: required with out_rows")
        out = x
    if out_rows is not None:
        check_array("out_rows", out_rows, np.int32, ("T",), dims)
        os_ = check_rows("out", out, np.uint16, (None, "heads", "D"), dims, align=2)
    else:
        os_ = check_rows("out", out, np.uint16, ("T", "heads", "D"), dims, align=2)
    table = cos is not None or sin is not None
    if table:
        if inv_freq is not None:
            raise ValueError("inv_freq: give either cos/sin tables or inv_freq, not both")
        check_array("cos", cos, np.float32, ("P", half), dims)
        check_array("sin", sin, np.float32, ("P", half), dims)
        max_pos = dims["P"]
    else:
        if inv_freq is None:
            raise ValueError("inv_freq: required when no cos/sin tables are given")
        check_array("inv_freq", inv_freq, np.float32, (half,), dims)
        max_pos = 0
    name = f"rope_kernel<{'true' if style == 'neox' else 'false'}, {'true' if table else 'false'}>"
    k = get_kernel(ROPE_SPEC, name)
    total = T * heads * half
    k((_grid(total),), (256,), (x, np.int64(xs[0]), np.int32(xs[1]), out, np.int64(os_[0]), np.int32(os_[1]),
                                _ptr(out_rows), positions, np.int32(T), np.int32(heads), np.int32(half),
                                _ptr(cos), _ptr(sin), np.int32(max_pos), _ptr(inv_freq), np.float32(amplitude)))
    return out[:, 0, :] if squeeze else out


HNR_D = 128          # head_norm_rope_kernel's head width (the drafter's head_dim)


def head_norm_rope(x, eps: float, positions, inv_freq, amplitude: float, w_a, out_a, w_b=None, out_b=None):
    """Per-head RMSNorm then NeoX RoPE of head-major x [n, T, 128] bf16 (a strided view allowed) in ONE
    launch: heads [0, n_a) with norm weight w_a [128] into out_a [T, n_a, 128], heads [n_a, n) with w_b
    into out_b [T, n - n_a, 128] (n_a = out_a.shape[1]). RoPE at positions int32 [T] with inv_freq float32
    [64] and ``amplitude``. The same numbers as ``rms_norm`` (rounded to bf16) then ``rope(style='neox')``
    (the drafter's q and k: one launch instead of four)."""
    dims = {}
    xs = check_rows("x", x, np.uint16, ("n", "T", HNR_D), dims)
    n, T = dims["n"], dims["T"]
    check_array("w_a", w_a, np.uint16, (HNR_D,))
    oa = check_rows("out_a", out_a, np.uint16, ("T", "n_a", HNR_D), dims)
    n_a = dims["n_a"]
    if n_a > n:
        raise ValueError(f"out_a: {n_a} heads, x has only {n}")
    ob = (0, 0, 1)
    if n_a < n:
        if w_b is None or out_b is None:
            raise ValueError(f"w_b / out_b: required for heads {n_a}..{n - 1} of x")
        check_array("w_b", w_b, np.uint16, (HNR_D,))
        ob = check_rows("out_b", out_b, np.uint16, ("T", n - n_a, HNR_D), dims)
    elif w_b is not None or out_b is not None:
        raise ValueError("w_b / out_b: given, but out_a takes every head of x")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: must be a positive float, got {eps!r}")
    check_array("positions", positions, np.int32, ("T",), dims)
    check_array("inv_freq", inv_freq, np.float32, (HNR_D // 2,))
    if n * T == 0:
        return out_a, out_b
    k = get_kernel(ROPE_SPEC, "head_norm_rope_kernel")
    k((_grid(n * T, 16),), (256,), (x, np.int64(xs[0]), np.int64(xs[1]), np.int32(T), np.int32(n), np.int32(n_a),
                                    w_a, _ptr(w_b), np.float32(eps), out_a, np.int64(oa[0]), np.int64(oa[1]),
                                    _ptr(out_b), np.int64(ob[0]), np.int64(ob[1]), positions, inv_freq,
                                    np.float32(amplitude)))
    return out_a, out_b


def rope_tables(inv_freq: np.ndarray, max_pos: int, amplitude: float = 1.0):
    """Host-side fp32 cos/sin tables [max_pos, D/2] from inv_freq, angles formed in float64."""
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    return (np.cos(ang) * amplitude).astype(np.float32), (np.sin(ang) * amplitude).astype(np.float32)


def silu_mul(gate_up, out=None):
    """out [T, I] = bf16(silu(gate) * up) for gate_up [T, 2I] = [gate | up] (row-strided view allowed)."""
    import cupy
    dims = {}
    gs = check_rows("gate_up", gate_up, np.uint16, ("T", None), dims)
    T, I2 = gate_up.shape
    if I2 % 16:
        raise ValueError(f"gate_up: width must be 2*I with I a multiple of 8, got {I2}")
    I = I2 // 2
    if out is None:
        out = cupy.empty((T, I), dtype=np.uint16)
    os_ = check_rows("out", out, np.uint16, ("T", I), dims)
    k = get_kernel(ACT_SPEC, "silu_mul_kernel")
    k((_grid(T * I // 8),), (256,), (gate_up, np.int64(gs[0]), out, np.int64(os_[0]), np.int32(T), np.int32(I)))
    return out


def embed(ids, table, vocab_start: int = 0, out=None):
    """out [T, H] = table[ids - vocab_start] for ids inside this shard's rows, zeros elsewhere.

    ids int32 [T], table bf16 [rows, H] (this rank's vocabulary shard, starting at ``vocab_start``)."""
    import cupy
    dims = {}
    check_array("ids", ids, np.int32, ("T",), dims)
    check_array("table", table, np.uint16, ("rows", "H"), dims)
    check_multiple("H (table.shape[1])", dims["H"], 8)
    check_range("vocab_start", vocab_start, 0, 2**31 - 1 - dims["rows"])
    T, H = dims["T"], dims["H"]
    if out is None:
        out = cupy.empty((T, H), dtype=np.uint16)
    os_ = check_rows("out", out, np.uint16, ("T", "H"), dims)
    if T == 0:
        return out
    k = get_kernel(EMBED_SPEC, "embed_gather_kernel")
    k((T,), (128,), (ids, table, np.int32(dims["rows"]), np.int32(vocab_start), np.int32(H), out, np.int64(os_[0])))
    return out
