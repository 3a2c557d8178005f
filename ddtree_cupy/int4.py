"""INT4 routed-expert weights in compressed-tensors' ``pack-quantized`` format (numpy only).

Format (symmetric W4A16, group 32; see docs/CHECKPOINTS.md and KIMI_K2_MODEL.md), for a linear with
logical weight W[N, K]:
  * ``weight_packed`` int32 [N, K/8]: element k of row n is nibble k % 8 of word packed[n, k // 8]
    read as uint32, i.e. ``nib = (word >> 4 * (k % 8)) & 0xF``, and ``q = nib - 8`` (range -8..7);
  * ``weight_scale`` bf16 [N, K/32] (stored here as uint16 bit patterns);
  * ``W[n, k] = q[n, k] * scale[n, k // 32]``.

The packing is defined on values, not on memory order: we shift uint32 words rather than splitting bytes,
so the result does not depend on the host's byte order.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from .bf16 import bf16_bits_to_f32, to_bf16_bits

GROUP = 32          # elements per scale (the only group size the kernels support)
PACK = 8            # 4-bit values per int32 word
QMIN, QMAX = -8, 7  # symmetric signed 4-bit range; the offset-binary nibble is q + 8


def _shape2(shape, what: str) -> Tuple[int, int]:
    try:
        n, k = (int(v) for v in np.asarray(shape).reshape(-1))
    except (TypeError, ValueError):
        raise ValueError(f"{what}: shape must hold two integers [N, K], got {shape!r}") from None
    if n <= 0 or k <= 0:
        raise ValueError(f"{what}: shape must be positive, got [{n}, {k}]")
    return n, k


def check_int4_shapes(packed: np.ndarray, scale: np.ndarray, shape: Sequence[int], group: int = GROUP,
                      what: str = "int4") -> Tuple[int, int]:
    """Raise ValueError unless packed/scale have the dtypes and shapes that ``shape`` = [N, K] implies."""
    n, k = _shape2(shape, what)
    if k % group:
        raise ValueError(f"{what}: K={k} is not a multiple of the group size {group}")
    if packed.dtype != np.int32:
        raise ValueError(f"{what}: weight_packed must be int32, got {packed.dtype}")
    if scale.dtype != np.uint16:
        raise ValueError(f"{what}: weight_scale must be bf16 bits (uint16), got {scale.dtype}")
    if tuple(packed.shape) != (n, k // PACK):
        raise ValueError(f"{what}: weight_packed shape {tuple(packed.shape)} != [N, K/8] = [{n}, {k // PACK}] "
                         f"for weight_shape [{n}, {k}]")
    if tuple(scale.shape) != (n, k // group):
        raise ValueError(f"{what}: weight_scale shape {tuple(scale.shape)} != [N, K/{group}] = [{n}, {k // group}] "
                         f"for weight_shape [{n}, {k}]")
    return n, k


def unpack_int4(packed: np.ndarray, scale, shape: Sequence[int]) -> np.ndarray:
    """int32 [N, K/8] -> int8 q [N, K] in -8..7 (K must be a multiple of 8).

    ``scale`` (bf16 bits [N, K/32]) is not needed for q; when given (not None) the (packed, scale, shape)
    triple is checked for consistency, which catches a scale of the wrong tensor early.
    """
    n, k = _shape2(shape, "unpack_int4")
    packed = np.asarray(packed)
    if scale is not None:
        check_int4_shapes(packed, np.asarray(scale), (n, k), GROUP, "unpack_int4")
    if packed.dtype != np.int32:
        raise ValueError(f"unpack_int4: packed must be int32, got {packed.dtype}")
    if k % PACK or tuple(packed.shape) != (n, k // PACK):
        raise ValueError(f"unpack_int4: packed shape {tuple(packed.shape)} does not hold shape [{n}, {k}] "
                         f"(expected [{n}, {k // PACK}] with K a multiple of 8)")
    words = packed.view(np.uint32)
    shifts = (4 * np.arange(PACK, dtype=np.uint32))
    nib = (words[:, :, None] >> shifts) & np.uint32(0xF)        # [N, K/8, 8]: nibble j of each word
    return (nib.astype(np.int8) - np.int8(8)).reshape(n, k)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 q [N, K] in -8..7 -> int32 [N, K/8] (inverse of ``unpack_int4``)."""
    q = np.asarray(q)
    if q.dtype != np.int8:
        raise ValueError(f"pack_int4: q must be int8, got {q.dtype}")
    if q.ndim != 2 or q.shape[1] % PACK:
        raise ValueError(f"pack_int4: q must be [N, K] with K a multiple of 8, got shape {q.shape}")
    if q.size and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError(f"pack_int4: q values must lie in [{QMIN}, {QMAX}], got [{q.min()}, {q.max()}]")
    n, k = q.shape
    nib = (q.astype(np.int32) + 8).astype(np.uint32).reshape(n, k // PACK, PACK)
    shifts = (4 * np.arange(PACK, dtype=np.uint32))
    words = np.bitwise_or.reduce(nib << shifts, axis=2)          # nibbles occupy disjoint bits
    return np.ascontiguousarray(words.astype(np.uint32)).view(np.int32)


def dequantize(packed: np.ndarray, scale: np.ndarray, shape: Sequence[int], dtype=np.float64,
               group: int = GROUP) -> np.ndarray:
    """W = q * scale, exact (4-bit q times an 8-bit-mantissa scale fits float32 and float64 exactly).

    This is what a kernel computes when it multiplies bf16(q) by bf16(scale) in fp32; see
    ``dequantize_bf16`` for compressed-tensors' rounded variant.
    """
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dequantize: dtype must be float32 or float64, got {dtype}")
    n, k = check_int4_shapes(np.asarray(packed), np.asarray(scale), shape, group, "dequantize")
    q = unpack_int4(packed, None, (n, k)).astype(dtype).reshape(n, k // group, group)
    s = bf16_bits_to_f32(np.asarray(scale)).astype(dtype)
    return (q * s[:, :, None]).reshape(n, k)


def dequantize_bf16(packed: np.ndarray, scale: np.ndarray, shape: Sequence[int], group: int = GROUP) -> np.ndarray:
    """bf16(q * scale) as uint16 bits: what compressed-tensors' decompressor returns (one bf16 rounding)."""
    return to_bf16_bits(dequantize(packed, scale, shape, np.float32, group))


def quantize_groupwise(w: np.ndarray, group: int = GROUP) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric per-group INT4 quantization of W[N, K] -> (packed int32 [N, K/8], scale bf16 bits [N, K/32]).

    scale = bf16(max|w| / 7.5) per group; q = clip(round(w / scale), -8, 7). Dividing by 7.5 (not 7) uses the
    asymmetric -8 end too: values near -max map to -8 without clipping error larger than half a step on the
    positive side. The scale is rounded to bf16 BEFORE computing q, so q is the best code for the stored scale.
    All-zero groups get scale 0 and q 0.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % group:
        raise ValueError(f"quantize_groupwise: w must be [N, K] with K a multiple of {group}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_groupwise: w contains NaN or Inf")
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    amax = np.abs(g).max(axis=2)
    scale_bits = to_bf16_bits(amax / np.float32(7.5))
    s = bf16_bits_to_f32(scale_bits)
    safe = np.where(s > 0, s, np.float32(1.0))
    q = np.clip(np.rint(g / safe[:, :, None]), QMIN, QMAX).astype(np.int8).reshape(n, k)
    return pack_int4(q), scale_bits
