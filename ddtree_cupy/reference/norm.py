"""RMSNorm, the one normalisation the target and the drafter use."""
from __future__ import annotations

import numpy as np


def compute_dtype(dtype) -> np.dtype:
    """The float type the reference does its arithmetic in: at least float32 (bf16/fp16 inputs are upcast)."""
    return np.promote_types(np.dtype(dtype), np.float32)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``w * x / sqrt(mean(x^2, last axis) + eps)``, computed in float32 or wider.

    The result has the wider of x's float type and float32 (a float64 input stays float64: the float64
    reference must not round through float32 anywhere).
    """
    x = np.asarray(x)
    w = np.asarray(w)
    if x.shape[-1:] != w.shape:
        raise ValueError(f"rms_norm: weight w has shape {w.shape}, expected ({x.shape[-1]},) to match x {x.shape}")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be positive, got {eps!r}")
    ct = compute_dtype(x.dtype)
    xf = x.astype(ct, copy=False)
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + ct.type(eps))
    return w.astype(ct, copy=False) * (xf * inv)
