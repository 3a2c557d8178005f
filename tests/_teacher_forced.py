"""Teacher-forced checking of greedy tokens against the numpy reference (shared by tests/gpu/test_engine.py,
bench/diag_verify.py and the CPU self-check tests/test_teacher_forced.py).

Comparing a GPU (bf16) greedy stream with the reference's own greedy stream stops being informative at the
first genuine near-tie: after it the two continuations differ and nothing later is checked. Instead, ONE
causal reference forward over prompt + the GPU's own output gives the reference logits at the position of
every emitted token, and every token is judged there:

* gap_i = (max reference logit - reference logit of the GPU's token) / logit std at that position;
  gap 0 = the GPU chose the reference argmax;
* a token is accepted when gap_i < near_tie (bf16-vs-float32 logit noise: measured per-row relative logit
  error ~1e-2, i.e. ~0.01 std per logit, ~0.015 std on a difference; near_tie = 0.05 std is > 3 sigma), or
  when gap_i < flip_tie AND the reference has a MoE routing near-tie at that position: the margin between
  the k-th and (k+1)-th expert's selection score (sigmoid + bias) in some MoE layer is below router_tie
  (the GPU's bf16 router input can then pick the other expert, which moves the logits by far more than the
  bf16 noise). Both exceptions are counted and reported.

A wrong token chosen by a real bug (a bad position, mask or cache row) has a gap of order 1 std and no
routing near-tie; tests/test_teacher_forced.py checks that corrupted sequences fail.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np

NEAR_TIE = 5e-2      # std units: bf16 logit noise bound (see above; bench/diag_verify.py measures it)
FLIP_TIE = 1.0       # std units: the largest gap accepted at a position with a routing near-tie
ROUTER_TIE = 1e-2    # selection-score units: a k-th / (k+1)-th expert margin the bf16 router can flip
                     # (the GPU router's measured selection-score error reaches 7e-3, ENGINE.md)


def router_margins(cfg, gate_w: np.ndarray, bias: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per row of x [T, H]: choice[k-1] - choice[k] of the noaux_tc selection scores (sigmoid(x @ gate^T) +
    bias), i.e. how far the last chosen expert is from the first one left out (groups: n_group must be 1
    or topk_group == n_group, as in the tiny checkpoint; otherwise the group stage would need modelling)."""
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        raise ValueError("router_margins: group-limited routing (topk_group < n_group) is not modelled")
    k = cfg.num_experts_per_tok
    logits = np.asarray(x, np.float64) @ np.asarray(gate_w, np.float64).T
    choice = 1.0 / (1.0 + np.exp(-logits)) + np.asarray(bias, np.float64)[None, :]
    top = -np.sort(-choice, axis=1)
    return top[:, k - 1] - top[:, k]


def reference_scores(ref, prompt: Sequence[int], out: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """One causal forward of ``ref`` (a ReferenceTarget) over prompt + out[:-1]. Returns the logits at the
    positions that chose out[0..n-1] (float64 [n, V]) and, per position, the smallest router margin over the
    MoE layers (float64 [n]; +inf for a dense model)."""
    ids = np.asarray(list(prompt) + list(out), np.int64)
    P, n = len(prompt), len(out)
    if n == 0:
        return np.zeros((0, ref.cfg.vocab_size)), np.zeros(0)
    margins = []
    orig = ref.mlp_block

    def recording(i, x):
        if ref.cfg.is_moe_layer(i):
            p = f"model.layers.{i}.mlp."
            margins.append(router_margins(ref.cfg, ref.w[p + "gate.weight"], ref.w[p + "gate.e_score_correction_bias"],
                                          x))
        return orig(i, x)

    ref.mlp_block = recording
    try:
        logits, _ = ref.forward(ids[:P + n - 1], np.arange(P + n - 1), ref.new_cache())
    finally:
        del ref.mlp_block
    m = np.min(np.stack(margins), axis=0) if margins else np.full(P + n - 1, np.inf)
    return np.asarray(logits[P - 1:], np.float64), m[P - 1:]


def judge(logits: np.ndarray, margins: np.ndarray, out: Sequence[int], near_tie: float = NEAR_TIE,
          flip_tie: float = FLIP_TIE, router_tie: float = ROUTER_TIE) -> Dict:
    """Per-token verdict on teacher-forced reference logits [n, V] and router margins [n] (see the module
    doc). Returns counts: n, identical (tokens equal to the reference argmax before the first that is not),
    non_argmax, max_gap (std), flips (tokens accepted only through a routing near-tie), bad (indices of
    unacceptable tokens), gaps [n], margins [n]."""
    out = np.asarray(out, np.int64)
    n = len(out)
    if logits.shape[0] != n or margins.shape[0] != n:
        raise ValueError(f"judge: {logits.shape[0]} logit rows / {margins.shape[0]} margins for {n} tokens")
    if n == 0:
        return dict(n=0, identical=0, non_argmax=0, max_gap=0.0, flips=0, bad=[], gaps=np.zeros(0),
                    margins=margins)
    std = logits.std(axis=1)
    gaps = (logits.max(axis=1) - logits[np.arange(n), out]) / std
    off = np.nonzero(gaps > 0)[0]
    ok_noise = gaps < near_tie
    ok_flip = (gaps < flip_tie) & (margins < router_tie)
    bad = np.nonzero(~(ok_noise | ok_flip))[0].tolist()
    return dict(n=n, identical=int(off[0]) if off.size else n, non_argmax=int(off.size), max_gap=float(gaps.max()),
                flips=int((~ok_noise & ok_flip).sum()), bad=bad, gaps=gaps, margins=margins)


def describe(what: str, v: Dict) -> str:
    s = (f"{what}: {v['n']} tokens, {v['identical']} identical to the reference argmax before the first "
         f"that is not, {v['non_argmax']} not the argmax, max gap {v['max_gap']:.3g} std, "
         f"{v['flips']} accepted through a routing near-tie")
    if v["bad"]:
        i = v["bad"][0]
        s += (f"; FIRST BAD token {i}: gap {v['gaps'][i]:.3g} std, router margin {v['margins'][i]:.3g} "
              f"({len(v['bad'])} bad)")
    return s


def check_stream(ref, prompt, out, what: str, **tol) -> Dict:
    """reference_scores + judge; asserts every token is acceptable, returns the verdict (printed)."""
    lg, m = reference_scores(ref, prompt, out)
    v = judge(lg, m, out, **tol)
    line = describe(what, v)
    print(line)
    assert not v["bad"], line
    return v


def check_lossless(ref, prompt, got, want, what: str, near_tie: float = NEAR_TIE, flip_tie: float = FLIP_TIE,
                   router_tie: float = ROUTER_TIE) -> int:
    """Two GPU streams that must be the same greedy decode (ddtree vs ar): equal token for token up to the
    first difference, and there the reference, on their common prefix, must see the two tokens as a tie
    (gap between them < near_tie, or < flip_tie with a routing near-tie). Returns the tokens matched."""
    n = min(len(got), len(want))
    for i in range(n):
        if got[i] != want[i]:
            lg, m = reference_scores(ref, prompt, list(want[:i + 1]))
            row = lg[-1]
            gap = abs(row[want[i]] - row[got[i]]) / row.std()
            ok = gap < near_tie or (gap < flip_tie and m[-1] < router_tie)
            line = (f"{what}: first difference at token {i} ({got[i]} vs {want[i]}): reference gap between them "
                    f"{gap:.3g} std, router margin {m[-1]:.3g}")
            print(line)
            assert ok, line + ": not a tie"
            return i
    assert len(got) == len(want), f"{what}: {len(got)} tokens vs {len(want)} (equal up to there)"
    return n
