"""Synthetic decode steps for the budget policy: drafters of controlled quality against a cost table.

A step of one stream is modelled at the level the policy sees it: for each draft depth d = 1..D the target's
next-token distribution p_d, the true continuation t_1..t_D drawn from it (a sampled target; ``greedy``
takes the argmax), and the drafter's per-depth distribution q_d. A tree node is accepted when its path is
t_1..t_d, which is exactly the walk of reference/ddtree.py with post[row] = t_(depth + 1). Two drafter
families:

* ``mixed_drafter(noise)``: q_d = (1 - noise) p_d + noise u_d with u_d uniform or a random distribution
  (the oracle drafter of tests/test_loop.py mixed with a tunable share of noise; noise = 1 with a random
  u_d is a random drafter);
* ``curve_drafter(accept)``: p_d puts mass c_d = accept[d] / accept[d - 1] on one token (the conditional
  acceptance of depth d for a top-1 chain whose cumulative per-depth acceptance is ``accept``) and spreads
  the rest geometrically; q_d = p_d (a calibrated drafter) or p_d sharpened/flattened by ``temp``.

``run`` replays the same random steps for every fixed budget (common random numbers) and for the policy,
and returns committed tokens per second of modelled step time for each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .budget import BudgetPolicy, CostTable, path_values, truncate_tree
from .reference.ddtree import build_tree, greedy_walk

KIMI_DFLASH_ACCEPT = (0.89, 0.75, 0.57, 0.49, 0.41, 0.34, 0.28)   # block-8 DFlash, per-depth (cumulative)


def _norm(x):
    return x / x.sum()


def mixed_drafter(noise: float, V: int = 64, peak: float = 3.0, alpha: Optional[float] = None) -> Callable:
    """f(rng, D) -> (p [D, V], q [D, V]): a random peaky target distribution and a drafter mixing it with
    ``noise`` share of noise: uniform (``alpha`` None), or a random Dirichlet(alpha) distribution per depth
    (overconfident in random tokens)."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise: must be in [0, 1], got {noise}")

    def f(rng, D):
        z = rng.standard_normal((D, V)) * peak
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        u = np.full((D, V), 1.0 / V) if alpha is None else rng.dirichlet(np.full(V, alpha), size=D)
        return p, (1.0 - noise) * p + noise * u
    return f


def curve_drafter(accept: Sequence[float] = KIMI_DFLASH_ACCEPT, V: int = 64, rho: float = 0.6,
                  temp: float = 1.0) -> Callable:
    """f(rng, D) -> (p, q) with top-1 conditional acceptance from the cumulative curve ``accept``."""
    a = np.asarray(accept, np.float64)
    if a.ndim != 1 or (a <= 0).any() or (a > 1).any():
        raise ValueError(f"accept: per-depth probabilities in (0, 1], got {accept}")
    c = np.clip(a / np.concatenate([[1.0], a[:-1]]), 1e-6, 1.0)

    def f(rng, D):
        if D > c.size:
            raise ValueError(f"curve_drafter: {c.size} depths given, {D} needed")
        p = np.empty((D, V))
        for d in range(D):
            tail = rho ** np.arange(V - 1)
            row = np.concatenate([[c[d]], (1.0 - c[d]) * tail / tail.sum()])
            p[d] = row[rng.permutation(V)]
        q = p ** (1.0 / temp)
        return p, q / q.sum(axis=1, keepdims=True)
    return f


def _tree(q: np.ndarray, budget: int):
    """(tree of ``budget`` nodes, its node probabilities) from drafter distributions q [D, V]."""
    from .reference.ddtree import depth_topk
    lq = np.log(np.maximum(q, 1e-300))
    lp, ids = depth_topk(lq, min(budget, q.shape[1]))
    lp = np.minimum(lp, 0.0)
    return build_tree(lp, ids, budget), path_values(lp, budget)


def accepted(tree, truth: np.ndarray):
    """Accepted rows of ``tree`` (first n nodes used) when the target's continuation is ``truth`` [D]."""
    tokens = np.concatenate([[-1], tree.tokens]).astype(np.int64)
    parents = np.concatenate([[-1], tree.parents]).astype(np.int64)
    depths = np.concatenate([[0], tree.depths]).astype(np.int64)
    post = np.where(depths < truth.size, truth[np.minimum(depths, truth.size - 1)], -2)
    rows, _ = greedy_walk(tokens, parents, post)
    return rows


@dataclass
class SimResult:
    tokens: Dict[str, float]        # committed tokens, per option ('ar', 'b1', ..., 'auto')
    seconds: Dict[str, float]       # modelled step time, per option
    budgets: List[float]            # the policy's mean budget per step

    def rate(self, name: str) -> float:
        return self.tokens[name] / self.seconds[name]

    def best_fixed(self) -> str:
        return max((k for k in self.tokens if k != "auto"), key=self.rate)


def run(drafters: Sequence[Callable], costs: CostTable, steps: int, budgets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        D: int = 7, max_nodes: int = 32, seed: int = 0, greedy: bool = False,
        policy: Optional[BudgetPolicy] = None, switch: Optional[Dict[int, Sequence[Callable]]] = None) -> SimResult:
    """``steps`` steps of len(drafters) streams (one drafter each; ``switch[step]`` replaces them from that
    step on). Fixed budgets and 'ar' see the same draws as the policy."""
    rng = np.random.default_rng(seed)
    S = len(drafters)
    pol = policy if policy is not None else BudgetPolicy(max_nodes, costs)
    names = ["ar"] + [f"b{b}" for b in budgets] + ["auto"]
    tok = {n: 0.0 for n in names}
    sec = {n: 0.0 for n in names}
    mean_b: List[float] = []
    cur = list(drafters)
    for step in range(steps):
        if switch and step in switch:
            cur = list(switch[step])
        draws = []
        for s in range(S):
            p, q = cur[s](rng, D)
            truth = np.array([rng.choice(p.shape[1], p=p[d]) if not greedy else int(np.argmax(p[d]))
                              for d in range(D)])
            tree, values = _tree(q, max_nodes)
            draws.append((tree, truth, values))
        tok["ar"] += S
        sec["ar"] += costs.root_s(S)
        for b in budgets:
            tok[f"b{b}"] += sum(len(accepted(truncate_tree(t, b), tr)) for t, tr, _ in draws)
            sec[f"b{b}"] += costs.draft_s(S, S * (b + 1))
        keys = list(range(S))
        want = set(pol.drafting(keys))
        raw = {k: draws[k][2] for k in keys if k in want}
        plan = pol.plan(S, keys, raw)
        sec["auto"] += plan.est_s
        mean_b.append(float(np.mean(list(plan.budgets.values()))))
        for k in keys:
            b = plan.budgets[k]
            if b > 0:
                rows = accepted(truncate_tree(draws[k][0], b), draws[k][1])
                pol.observe(k, raw[k][:b], len(rows))
            else:
                rows = [0]
                pol.note_root_only(k, 1)
            tok["auto"] += len(rows)
    return SimResult(tok, sec, mean_b)
