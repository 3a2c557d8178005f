"""Mixture-of-experts pieces of the target: the noaux_tc sigmoid router and the SwiGLU experts."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config import TargetConfig
from .norm import compute_dtype


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_mlp(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    """``down(silu(gate(x)) * up(x))`` with HF-layout weights ([out, in]). Dense layers and every expert."""
    return (silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def _top_indices(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row, best first; equal values: the lower index first."""
    # a stable sort of -v keeps equal entries in index order
    return np.argsort(-v, axis=-1, kind="stable")[..., :k]


def route(x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray, cfg: TargetConfig, real=None):
    """noaux_tc routing. x: [T, H]; gate_w: [E, H]; bias: [E] (e_score_correction_bias).

    s = sigmoid(x @ gate_w^T) (float32 or wider); choice = s + bias picks the experts, the bias only ever
    chooses. With n_group > 1 the experts are split into n_group contiguous groups, each group is scored by the
    sum of its two best choice values, and only the topk_group best groups stay eligible. The top
    num_experts_per_tok eligible experts by choice are taken (ties: lower expert id). Their weights are the
    UNBIASED s, normalised to sum 1 when norm_topk_prob, times routed_scaling_factor.

    ``real`` (bool [T], optional): rows marked False are padding (rows of a static verify shape beyond a
    stream's tree): they select no expert (ids -1, weights 0), so they add no expert work; the real rows'
    selection is unchanged (cuda_src/router.cu's row_pos). ``moe_experts`` skips ids -1.

    Returns ids int64 [T, k] (best choice first) and weights [T, k].
    """
    x = np.asarray(x)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"route: x has shape {x.shape}, expected [T, {cfg.hidden_size}]")
    if np.shape(gate_w) != (E, cfg.hidden_size):
        raise ValueError(f"route: gate_w has shape {np.shape(gate_w)}, expected ({E}, {cfg.hidden_size})")
    if np.shape(bias) != (E,):
        raise ValueError(f"route: bias (e_score_correction_bias) has shape {np.shape(bias)}, expected ({E},)")
    ct = compute_dtype(x.dtype)
    logits = x.astype(ct, copy=False) @ np.asarray(gate_w, dtype=ct).T
    s = 1.0 / (1.0 + np.exp(-logits))                                   # [T, E]
    choice = s + np.asarray(bias, dtype=ct)[None, :]
    G, TG = cfg.n_group, cfg.topk_group
    if G > 1 and TG < G:
        per = E // G
        grouped = choice.reshape(-1, G, per)
        best2 = np.sort(grouped, axis=-1)[..., ::-1][..., :min(2, per)]
        group_score = best2.sum(axis=-1)                                # [T, G]
        keep = _top_indices(group_score, TG)                            # [T, TG]
        eligible = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(eligible, keep, True, axis=-1)
        choice = np.where(np.repeat(eligible, per, axis=-1), choice, -np.inf)
    ids = _top_indices(choice, k)
    w = np.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    ids, w = ids.astype(np.int64), w * ct.type(cfg.routed_scaling_factor)
    if real is not None:
        real = np.asarray(real, bool)
        if real.shape != (x.shape[0],):
            raise ValueError(f"route: real has shape {real.shape}, expected ({x.shape[0]},)")
        ids[~real] = -1
        w[~real] = 0
    return ids, w


def moe_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                gate_w: Sequence[np.ndarray], up_w: Sequence[np.ndarray], down_w: Sequence[np.ndarray]) -> np.ndarray:
    """Weighted sum of the routed experts: y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).

    gate_w/up_w[e]: [I, H], down_w[e]: [H, I]; a stacked [E, I, H] array or a list indexed by expert id.
    The shared expert is NOT included (add ``swiglu_mlp`` of the shared weights). ids -1 (a padding row's,
    ``route(real=)``) select nothing.
    """
    x = np.asarray(x)
    ids = np.asarray(ids)
    weights = np.asarray(weights)
    if x.ndim != 2:
        raise ValueError(f"moe_experts: x must be [T, H], got shape {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"moe_experts: ids {ids.shape} and weights {weights.shape} must both be [T={x.shape[0]}, k]")
    E = len(gate_w)
    if len(up_w) != E or len(down_w) != E:
        raise ValueError(f"moe_experts: gate_w/up_w/down_w hold {E}/{len(up_w)}/{len(down_w)} experts")
    if ids.size and (ids.min() < -1 or ids.max() >= E):
        raise ValueError(f"moe_experts: ids must lie in [0, {E}) (or -1: no expert), got range "
                         f"[{ids.min()}, {ids.max()}]")
    ct = compute_dtype(x.dtype)
    x = x.astype(ct, copy=False)
    y = np.zeros_like(x)
    for e in np.unique(ids[ids >= 0]):
        rows, slot = np.nonzero(ids == e)
        out = swiglu_mlp(x[rows], np.asarray(gate_w[e], ct), np.asarray(up_w[e], ct), np.asarray(down_w[e], ct))
        # add.at: correct even if a caller lists one expert twice for a token
        np.add.at(y, rows, weights[rows, slot].astype(ct)[:, None] * out)
    return y
