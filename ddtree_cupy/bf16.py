"""bfloat16 without a bfloat16 dtype: bf16 tensors are stored as uint16 bit patterns (numpy and CuPy).

The engine's only run-time dependencies are numpy/safetensors/tiktoken, so it cannot rely on ml_dtypes;
these two conversions are all it needs. Rounding is IEEE round-to-nearest-even, as __float2bfloat16_rn.
"""
from __future__ import annotations

import numpy as np


def to_bf16_bits(x) -> np.ndarray:
    """float array -> uint16 bf16 bit patterns, round to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    if nan.any():
        out = np.where(nan, np.uint16(0x7FC0), out)
    return out


def bf16_bits_to_f32(b) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    b = np.asarray(b)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """Round a float array to the nearest bf16 value, returned as float32."""
    return bf16_bits_to_f32(to_bf16_bits(x))
