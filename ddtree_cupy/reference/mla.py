"""Multi-head latent attention (MLA) over the latent KV cache, in the naive and the absorbed form.

Cache rows are ``[c_kv (r) | k_pe (d_rope)]``: the RMS-normalised KV latent and the rotated shared rope key.
kv_b_proj [n_h * (d_nope + d_v), r] is head-major: per head, d_nope rows of W_UK then d_v rows of W_UV.

naive:    k[h, s] = [W_UK[h] c_kv[s] | k_pe[s]], v[h, s] = W_UV[h] c_kv[s], standard attention per head.
absorbed: q_lat[h] = W_UK[h]^T q_nope[h] (so q_nope . k_nope = q_lat . c_kv), attend over the latent rows
          (one 576-wide key / 512-wide value shared by all heads), o[h] = W_UV[h] o_lat[h].
Both give the same numbers up to rounding; the absorbed form is what the GPU decode/verify kernels compute.
"""
from __future__ import annotations

import numpy as np

from .norm import compute_dtype


def split_kv_b(kv_b_w: np.ndarray, n_heads: int, d_nope: int, d_v: int):
    """kv_b_proj.weight [n_h*(d_nope+d_v), r] -> (W_UK [n_h, d_nope, r], W_UV [n_h, d_v, r])."""
    kv_b_w = np.asarray(kv_b_w)
    if kv_b_w.ndim != 2 or kv_b_w.shape[0] != n_heads * (d_nope + d_v):
        raise ValueError(f"split_kv_b: kv_b_proj weight has shape {kv_b_w.shape}, expected "
                         f"[{n_heads * (d_nope + d_v)}, r]")
    w = kv_b_w.reshape(n_heads, d_nope + d_v, kv_b_w.shape[1])
    return w[:, :d_nope, :], w[:, d_nope:, :]


def _softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis restricted to ``allowed`` (broadcast against scores)."""
    scores = np.where(allowed, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - m)
    return p / p.sum(axis=-1, keepdims=True)


def _check(q_nope, q_pe, latent, w_uk, w_uv, allowed, fn):
    T, H, dn = q_nope.shape
    r = w_uk.shape[-1]
    if q_pe.ndim != 3 or q_pe.shape[:2] != (T, H):
        raise ValueError(f"{fn}: q_pe has shape {q_pe.shape}, expected [{T}, {H}, d_rope]")
    dr = q_pe.shape[2]
    if latent.ndim != 2 or latent.shape[1] != r + dr:
        raise ValueError(f"{fn}: latent has shape {latent.shape}, expected [S, {r + dr}] (c_kv {r} | k_pe {dr})")
    if w_uk.shape != (H, dn, r):
        raise ValueError(f"{fn}: w_uk has shape {w_uk.shape}, expected ({H}, {dn}, {r})")
    if w_uv.ndim != 3 or w_uv.shape[0] != H or w_uv.shape[2] != r:
        raise ValueError(f"{fn}: w_uv has shape {w_uv.shape}, expected ({H}, d_v, {r})")
    S = latent.shape[0]
    if allowed.shape != (T, S) or allowed.dtype != np.bool_:
        raise ValueError(f"{fn}: allowed must be bool [{T}, {S}], got {allowed.dtype} {allowed.shape}")
    empty = ~allowed.any(axis=1)
    if empty.any():
        raise ValueError(f"{fn}: query rows {np.nonzero(empty)[0].tolist()} see no key at all")
    return r


def latent_attention(q_lat: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, allowed: np.ndarray,
                     softmax_scale: float) -> np.ndarray:
    """The core of absorbed MLA (one shared latent head, MQA): q_lat [T, n_h, r], q_pe [T, n_h, d_rope],
    latent [S, r + d_rope], allowed bool [T, S] -> o_lat [T, n_h, r].
    score[t, h, s] = (q_lat[t,h] . c_kv[s] + q_pe[t,h] . k_pe[s]) * softmax_scale; softmax over allowed s."""
    r = q_lat.shape[-1]
    c_kv, k_pe = latent[:, :r], latent[:, r:]
    scores = (np.einsum("thr,sr->ths", q_lat, c_kv) + np.einsum("thd,sd->ths", q_pe, k_pe)) * softmax_scale
    p = _softmax_rows(scores, allowed[:, None, :])
    return np.einsum("ths,sr->thr", p, c_kv)


def mla_attention_absorbed(q_nope, q_pe, latent, w_uk, w_uv, allowed, softmax_scale):
    """Absorbed MLA. q_nope [T, n_h, d_nope], q_pe [T, n_h, d_rope] (already rotated), latent [S, r + d_rope]
    (cache rows plus this step's rows), w_uk [n_h, d_nope, r], w_uv [n_h, d_v, r], allowed bool [T, S].
    Returns the per-head outputs [T, n_h, d_v] (before o_proj)."""
    ct = compute_dtype(np.asarray(q_nope).dtype)
    q_nope, q_pe, latent, w_uk, w_uv = (np.asarray(a, dtype=ct) for a in (q_nope, q_pe, latent, w_uk, w_uv))
    allowed = np.asarray(allowed)
    _check(q_nope, q_pe, latent, w_uk, w_uv, allowed, "mla_attention_absorbed")
    q_lat = np.einsum("thd,hdr->thr", q_nope, w_uk)
    o_lat = latent_attention(q_lat, q_pe, latent, allowed, softmax_scale)
    return np.einsum("thr,hvr->thv", o_lat, w_uv)


def mla_attention_naive(q_nope, q_pe, latent, w_uk, w_uv, allowed, softmax_scale):
    """Same contract as ``mla_attention_absorbed``, computed by materialising per-head K and V."""
    ct = compute_dtype(np.asarray(q_nope).dtype)
    q_nope, q_pe, latent, w_uk, w_uv = (np.asarray(a, dtype=ct) for a in (q_nope, q_pe, latent, w_uk, w_uv))
    allowed = np.asarray(allowed)
    r = _check(q_nope, q_pe, latent, w_uk, w_uv, allowed, "mla_attention_naive")
    c_kv, k_pe = latent[:, :r], latent[:, r:]
    k_nope = np.einsum("hdr,sr->hsd", w_uk, c_kv)                         # [n_h, S, d_nope]
    v = np.einsum("hvr,sr->hsv", w_uv, c_kv)                              # [n_h, S, d_v]
    n_h, S = k_nope.shape[:2]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[None], (n_h, S, k_pe.shape[1]))], axis=-1)
    q = np.concatenate([q_nope, q_pe], axis=-1)                           # [T, n_h, d_qk]
    scores = np.einsum("thd,hsd->ths", q, k) * softmax_scale
    p = _softmax_rows(scores, allowed[:, None, :])
    return np.einsum("ths,hsv->thv", p, v)
