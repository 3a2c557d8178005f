"""Rotary position embeddings: YaRN inverse frequencies and the two pairings.

* ``apply_rope_adjacent``: pairs (2i, 2i+1), rotated in place (GPT-J / "interleaved"). The Kimi/DeepSeek-V3
  target uses this on the 64-dim rope parts of q and k; the output keeps the adjacent layout.
* ``apply_rope_rotate_half``: pairs (i, i + D/2) (NeoX / HF ``rotate_half``), used by the Qwen3-style drafter.

Angles ``pos * inv_freq`` are formed in float64 whatever the input type (positions reach 2^18, where float32
angles would lose ~0.01 rad), then cos/sin are cast to the compute type of x.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import RopeConfig
from .norm import compute_dtype


def yarn_inv_freq(rope_cfg: RopeConfig, dim: int) -> np.ndarray:
    """Inverse frequencies (float64, [dim/2]) for a rotary part of width ``dim``.

    'default': theta^(-2i/dim). 'yarn': extrapolated and interpolated (/factor) frequencies blended by a linear
    ramp over pair indices [low, high], where low/high are the pair indices whose wavelength makes beta_fast /
    beta_slow turns over original_max_position_embeddings (floored/ceiled and clipped to [0, dim-1]).
    """
    if not isinstance(dim, (int, np.integer)) or dim <= 0 or dim % 2:
        raise ValueError(f"yarn_inv_freq: dim must be a positive even int, got {dim!r}")
    theta = float(rope_cfg.theta)
    i = np.arange(dim // 2, dtype=np.float64)
    extra = theta ** (-2.0 * i / dim)
    if rope_cfg.kind == "default":
        return extra
    if rope_cfg.kind != "yarn":
        raise ValueError(f"yarn_inv_freq: unsupported rope kind {rope_cfg.kind!r}")
    inter = extra / float(rope_cfg.factor)
    orig = float(rope_cfg.original_max_position_embeddings)

    def corr(rot: float) -> float:
        # pair index whose wavelength fits `rot` full turns into the original context
        return dim * math.log(orig / (rot * 2.0 * math.pi)) / (2.0 * math.log(theta))

    low = max(math.floor(corr(rope_cfg.beta_fast)), 0)
    high = min(math.ceil(corr(rope_cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    # ramp 0 (fast-turning pairs) keeps the original frequency, ramp 1 (slow pairs) is fully interpolated
    return inter * ramp + extra * (1.0 - ramp)


def _cos_sin(x: np.ndarray, pos, inv_freq, amplitude: float, fn: str):
    x = np.asarray(x)
    pos = np.asarray(pos)
    inv_freq = np.asarray(inv_freq, dtype=np.float64)
    if x.ndim < 2:
        raise ValueError(f"{fn}: x must be [T, ..., D], got shape {x.shape}")
    d = x.shape[-1]
    if inv_freq.shape != (d // 2,) or d % 2:
        raise ValueError(f"{fn}: inv_freq has shape {inv_freq.shape}, expected ({d // 2},) for x width {d}")
    if pos.shape != (x.shape[0],):
        raise ValueError(f"{fn}: pos has shape {pos.shape}, expected ({x.shape[0]},) (one position per row of x)")
    if not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"{fn}: pos must hold integers, got dtype {pos.dtype}")
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]            # [T, D/2], float64
    ct = compute_dtype(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d // 2,)              # broadcast over head axes
    cos = (np.cos(ang) * amplitude).astype(ct).reshape(shape)
    sin = (np.sin(ang) * amplitude).astype(ct).reshape(shape)
    return x.astype(ct, copy=False), cos, sin


def apply_rope_adjacent(x: np.ndarray, pos, inv_freq, amplitude: float = 1.0) -> np.ndarray:
    """Rotate adjacent pairs: out[2i] = a x[2i] - b x[2i+1], out[2i+1] = a x[2i+1] + b x[2i] with
    a = amplitude cos(pos inv_freq[i]), b = amplitude sin(pos inv_freq[i]). x: [T, ..., D]; pos: int [T]."""
    x, cos, sin = _cos_sin(x, pos, inv_freq, amplitude, "apply_rope_adjacent")
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def apply_rope_rotate_half(x: np.ndarray, pos, inv_freq, amplitude: float = 1.0) -> np.ndarray:
    """NeoX pairing: element i pairs with i + D/2. out[i] = a x[i] - b x[i+D/2], out[i+D/2] = a x[i+D/2] + b x[i].
    x: [T, ..., D]; pos: int [T]."""
    x, cos, sin = _cos_sin(x, pos, inv_freq, amplitude, "apply_rope_rotate_half")
    h = x.shape[-1] // 2
    lo, hi = x[..., :h], x[..., h:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)
