"""The tree budget of every stream at every step, from a cost model (``--budget auto``).

Each step, for the running streams of one stream bucket S:

1. Value of a node. The builder pops prefixes best-first, so the tree of budget b is the first b nodes of the
   tree of the largest budget (docs/DDTREE.md, the total order), and a node's path probability
   p = exp(score) is the drafter's probability that the target's accepted path passes through it. With a
   calibrated drafter the expected accepted length of the tree of b nodes is E(b) = 1 + sum_{i < b} p_i
   (linearity: the accepted length is the root plus the number of nodes on the accepted path).
2. Calibration (``Calibration``): the drafter's probabilities are not calibrated. Per stream, one ratio:
   over the nodes the stream verified, H = how many lay on the accepted path, M = the sum of their raw p,
   n = how many there were (each sum decayed by ``decay`` per verified step). The corrected node value is
       q = min(1, p * (H + W pbar) / (M + W pbar)),   pbar = M / n,  W = PRIOR_NODES
   (W pseudo-nodes that behave as the drafter says: with no data q = p; the prior scales with the raw
   probabilities, so a drafter whose raw values are tiny but right is trusted after a few hits). One factor
   keeps q in build order non-increasing, so E(b) stays concave. With ``decay`` 0.95 a stream whose
   acceptance changes mid-run is re-learnt in a few tens of steps.
3. Cost (``CostTable``): seconds of one step per (stream bucket, real verify rows of the step) for a step
   that drafts, and per bucket for a root-only step that does not draft. Padding rows of the static graph
   select no expert (the router masks them), so the MoE's bytes follow the real rows; the table is measured
   on the GPU (bench/step.py, or the engine's own step times) or loaded from a file, ``CostTable.model``
   otherwise.
4. Choice (``BudgetPolicy.plan``): all streams' corrected node values are merged in one descending list
   (each stream's list is non-increasing, so the best allocation of N nodes in total is the N largest
   values); the step takes the N that maximises
       tokens(N) - rate * cost.draft_s(S, n_streams + N),   tokens(N) = n_streams + sum of the N largest q
   where rate = the recent expected tokens per second of the policy's own steps (decayed sums, RATE_DECAY):
   maximising "tokens - rate x time" per step is what maximises the long-run tokens per second (the
   Dinkelbach form of a ratio objective; the step's own ratio tokens / time would favour short steps). The
   first step, without history, maximises its ratio. A stream's budget is the count of its nodes among
   the N (budgets differ per stream; the graph shape stays that of the largest budget).
5. Fall-back and probes: a drafted stream that earns no node on ``fallback_after`` drafted steps in a row
   stops drafting; so do all streams when drafting at all scores below a root-only step without the
   drafter (``cost.root_s``, what 'ar' runs). When no running stream drafts the step is root-only without
   the drafter. A stream in fall-back probes at the next multiple of its wait (``probe_every``; streams
   with equal waits probe in the same step; at least one wait after it fell back) with a tree of
   ``probe_nodes`` nodes. A probe that accepts a node returns the stream to planning for one drafted step
   (it stays if it earns nodes); a probe that accepts nothing, or a return that earns nothing, doubles the
   wait (up to ``probe_max``); earning nodes resets it.

Every decision depends only on the drafter's outputs, the observed acceptance and the cost table, so the
reference loop and the GPU engine make the same choices from the same inputs; any tree is verified by the
target, so the output is the same as 'ar' whatever the policy chooses (lossless).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

DEFAULT_MAX_NODES = 32       # the graph shape of ``--budget auto``: 33 verify rows per stream slot
PRIOR_NODES = 4.0            # pseudo-nodes of "the drafter is right" in the calibration
RATE_DECAY = 0.95            # the tokens/s the objective trades against: ~20 recent steps
MIN_VALUE = 1e-6             # node values below this are worth nothing (numerical floor)


def parse_budget(text) -> object:
    """``'auto'`` | ``'auto:N'`` (N = the largest per-stream budget) | an integer budget -> 'auto', ('auto', N)
    or int. Raises ValueError naming the problem."""
    if isinstance(text, (int, np.integer)):
        return int(text)
    s = str(text).strip().lower()
    if s == "auto":
        return "auto"
    if s.startswith("auto:"):
        n = s[5:]
        if not n.isdigit():
            raise ValueError(f"budget: 'auto:N' needs an integer N, got {text!r}")
        return ("auto", int(n))
    if s.lstrip("-").isdigit():
        return int(s)
    raise ValueError(f"budget: expected 'auto', 'auto:N' or an integer, got {text!r}")


# ----------------------------------------------------------------------------------------------------
# node values
# ----------------------------------------------------------------------------------------------------
def path_values(top_lp: np.ndarray, n: int, cap_k: Optional[int] = None) -> np.ndarray:
    """The n largest path probabilities exp(sum of log-probs along a path) of the trees of per-depth top-K
    lists ``top_lp [S, D, K]`` (or [D, K]), descending: [S, n] (rows padded with 0 when fewer paths exist).
    A child's score is at most its parent's, so the n best prefixes are prefix-closed: these are the node
    probabilities of ``build_tree(budget=n)`` in its build order (up to float rounding and the order of
    equal values). Vectorised over streams: per depth, the n best paths of that depth are among the n best
    of the depth above extended by each of the K tokens."""
    lp = np.asarray(top_lp, np.float64)
    one = lp.ndim == 2
    if one:
        lp = lp[None]
    if lp.ndim != 3:
        raise ValueError(f"top_lp: expected [S, D, K] or [D, K], got shape {np.shape(top_lp)}")
    S, D, K = lp.shape
    if cap_k is not None:
        lp = lp[:, :, :max(1, min(K, int(cap_k)))]
        K = lp.shape[2]
    n = int(n)
    if n < 1:
        out = np.zeros((S, 0))
        return out[0] if one else out
    frontier = lp[:, 0, :][:, :n]                           # depth-1 paths, best first (rows are sorted)
    found = [frontier]
    for d in range(1, D):
        ext = (frontier[:, :, None] + lp[:, d, None, :]).reshape(S, -1)
        m = min(n, ext.shape[1])
        frontier = -np.sort(-np.partition(ext, ext.shape[1] - m, axis=1)[:, ext.shape[1] - m:], axis=1)
        found.append(frontier)
    allp = np.concatenate(found, axis=1)
    m = min(n, allp.shape[1])
    best = -np.sort(-np.partition(allp, allp.shape[1] - m, axis=1)[:, allp.shape[1] - m:], axis=1)
    out = np.zeros((S, n))
    out[:, :m] = np.exp(best)
    return out[0] if one else out


def truncate_tree(tree, b: int):
    """The tree of budget ``b`` from the tree of a larger budget: its first b nodes (the builder's order is
    total and prefix-closed, so this equals ``build_tree(..., budget=b)`` without ``include_chain``)."""
    from .reference.ddtree import Tree
    b = max(0, min(int(b), tree.n))
    return Tree(tree.tokens[:b], tree.parents[:b], tree.depths[:b], tree.ranks[:b], tree.scores[:b])


def expected_lengths(q: np.ndarray) -> np.ndarray:
    """E(b) for b = 0..len(q): 1 + the cumulative sum of the node values."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.asarray(q, np.float64))])


class Calibration:
    """One stream's correction of the drafter's path probabilities (see the module doc):
    q = min(1, p * (H + W pbar) / (M + W pbar)), H / M / n = decayed sums of hits / raw p / nodes over the
    stream's verified nodes, pbar = M / n (W = PRIOR_NODES pseudo-nodes at ratio 1; no data: q = p)."""

    def __init__(self, decay: float = 0.95):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"calibration decay: must be in (0, 1], got {decay}")
        self.decay = float(decay)
        self.hits = self.mass = self.nodes = 0.0
        self.steps = 0

    def ratio(self) -> float:
        if self.nodes <= 0:
            return 1.0
        prior = PRIOR_NODES * self.mass / self.nodes
        return (self.hits + prior) / (self.mass + prior) if self.mass + prior > 0 else 1.0

    def correct(self, p: np.ndarray) -> np.ndarray:
        """Corrected node values of raw probabilities in build order (non-increasing, in [0, 1])."""
        q = np.minimum(1.0, np.asarray(p, np.float64) * self.ratio())
        return np.where(q < MIN_VALUE, 0.0, q)

    def observe(self, p: np.ndarray, hits: int) -> None:
        """One verified tree: the raw probabilities ``p`` of its nodes and how many of them lay on the
        accepted path (accepted length - 1)."""
        p = np.asarray(p, np.float64)
        if p.size == 0:
            return
        if not 0 <= hits <= p.size:
            raise ValueError(f"calibration: {hits} accepted nodes of a tree of {p.size}")
        d = self.decay
        self.hits = d * self.hits + float(hits)
        self.mass = d * self.mass + float(p.sum())
        self.nodes = d * self.nodes + float(p.size)
        self.steps += 1


# ----------------------------------------------------------------------------------------------------
# step cost
# ----------------------------------------------------------------------------------------------------
def unique_experts(rows: float, n_experts: int = 384, k: int = 8) -> float:
    """Expected distinct experts touched by ``rows`` rows that each pick k of n uniformly (real routing is
    about this spread, bench/step.py --routing)."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** max(0.0, float(rows)))


class CostTable:
    """Step seconds: ``draft_s(S, rows)`` for a drafting step of bucket S with ``rows`` real verify rows in
    all (roots included), ``root_s(S)`` for a root-only step without the drafter. Points per bucket are
    interpolated linearly in rows (beyond the last point: its last segment's slope); a bucket without
    points uses the nearest larger bucket's (else the largest)."""

    def __init__(self, draft: Dict[int, Dict[int, float]], root: Dict[int, float], source: str = "given"):
        self.draft = {int(s): {int(r): float(t) for r, t in pts.items()} for s, pts in draft.items()}
        self.root = {int(s): float(t) for s, t in root.items()}
        self.source = source
        for s, pts in self.draft.items():
            if not pts:
                raise ValueError(f"cost table: bucket {s} has no draft points")
            for r, t in pts.items():
                if r < 1 or not (t > 0 and math.isfinite(t)):
                    raise ValueError(f"cost table: bucket {s}, rows {r}: need rows >= 1 and a positive time, got {t}")
        for s, t in self.root.items():
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"cost table: root bucket {s}: need a positive time, got {t}")
        if not self.draft or not self.root:
            raise ValueError("cost table: needs draft points and root-only times")

    @staticmethod
    def _bucket(S: int, keys: Iterable[int]) -> int:
        ks = sorted(keys)
        for k in ks:
            if k >= S:
                return k
        return ks[-1]

    def draft_s(self, S: int, rows):
        """Seconds of a drafting step of bucket S with ``rows`` real rows (a number or an array of them)."""
        pts = self.draft[self._bucket(S, self.draft)]
        xs = np.array(sorted(pts), np.float64)
        ys = np.array([pts[int(x)] for x in xs])
        r = np.asarray(rows, np.float64)
        if xs.size == 1:
            out = np.full(r.shape, ys[0])
        else:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            out = np.where(r <= xs[-1], np.interp(r, xs, ys), ys[-1] + slope * (r - xs[-1]))
        return float(out) if out.ndim == 0 else out

    def root_s(self, S: int) -> float:
        return self.root[self._bucket(S, self.root)]

    def observe(self, kind: str, S: int, rows: int, seconds: float, weight: float = 0.2) -> None:
        """Fold a measured step time into the table (exponential average at that exact point)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if kind == "root":
            old = self.root.get(S)
            self.root[S] = seconds if old is None else (1 - weight) * old + weight * seconds
        else:
            pts = self.draft.setdefault(S, {})
            old = pts.get(int(rows))
            pts[int(rows)] = seconds if old is None else (1 - weight) * old + weight * seconds
        if "online" not in self.source:
            self.source += "+online"

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def model(cls, buckets: Sequence[int] = (1, 2, 4, 8, 10), max_rows_per_stream: int = 129,
              base_s: float = 3.74e-3, per_expert_s: float = 6.7e-5, per_stream_s: float = 1.6e-4,
              draft_s: float = 6.0e-4, n_experts: int = 384, k: int = 8) -> "CostTable":
        """A table from a model of one TP = 8 rank's step on the H200 (bench/step.py, docs/ENGINE.md:
        1 x 8 rows 8.3 ms, 1 x 16 11.4 ms, 1 x 32 16.7 ms, 10 x 8 27.3 ms): base + per expert touched x the
        expected unique experts of the real rows + per stream; the root-only step has no draft phase."""
        draft: Dict[int, Dict[int, float]] = {}
        root: Dict[int, float] = {}
        for S in buckets:
            grid = sorted({S * r for r in (1, 2, 3, 5, 9, 17, 33, 65, 129) if r <= max_rows_per_stream})
            draft[S] = {g: base_s + per_expert_s * unique_experts(g, n_experts, k) + per_stream_s * S for g in grid}
            root[S] = base_s - draft_s + per_expert_s * unique_experts(S, n_experts, k) + per_stream_s * S
        return cls(draft, root, source="model")

    @classmethod
    def load(cls, path: str) -> "CostTable":
        """JSON {"draft": {"S": {"rows": seconds}}, "root": {"S": seconds}} (what ``save`` writes)."""
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cost table {path}: cannot read ({e})") from None
        if not isinstance(d, dict) or "draft" not in d or "root" not in d:
            raise ValueError(f"cost table {path}: expected an object with 'draft' and 'root'")
        return cls(d["draft"], d["root"], source=f"file {path}")

    def to_dict(self) -> dict:
        return {"draft": {str(s): {str(r): t for r, t in sorted(p.items())} for s, p in sorted(self.draft.items())},
                "root": {str(s): t for s, t in sorted(self.root.items())}, "source": self.source}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


# ----------------------------------------------------------------------------------------------------
# the policy
# ----------------------------------------------------------------------------------------------------
@dataclass
class StreamBudgetState:
    cal: Calibration
    fallback: bool = False
    next_probe: int = 0
    failed_probes: int = 0
    probing: bool = False
    idle: int = 0                # drafted steps in a row without an earned node
    after_probe: bool = False    # back from a probe that hit, no node earned since
    expected: List[float] = field(default_factory=list)
    realised: List[int] = field(default_factory=list)
    budgets: List[int] = field(default_factory=list)


@dataclass
class Plan:
    """One step's decision: ``budgets[key]`` nodes per stream (0 = root only), ``draft`` whether the step
    runs the drafter, ``expected[key]`` = 1 + the corrected values of the chosen nodes, ``est_s`` the cost
    table's step time, ``est_tokens_per_s`` = sum(expected) / est_s, ``probes`` the probing streams."""
    budgets: Dict[object, int]
    draft: bool
    expected: Dict[object, float]
    est_s: float
    est_tokens_per_s: float
    probes: List[object]


class BudgetPolicy:
    """Per-step, per-stream tree budgets (module doc). Keys identify streams (the loop's stream index)."""

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES, costs: Optional[CostTable] = None,
                 probe_every: int = 8, probe_max: int = 128, probe_nodes: int = 3, fallback_after: int = 10,
                 decay: float = 0.95, record: bool = True):
        from .reference.ddtree import MAX_TREE_ROWS
        if not isinstance(max_nodes, (int, np.integer)) or not 1 <= max_nodes <= MAX_TREE_ROWS - 1:
            raise ValueError(f"budget auto: the largest budget must be in [1, {MAX_TREE_ROWS - 1}], got {max_nodes!r}")
        if probe_every < 1 or probe_max < probe_every:
            raise ValueError(f"budget auto: need 1 <= probe_every <= probe_max, got {probe_every}, {probe_max}")
        if probe_nodes < 1 or fallback_after < 1:
            raise ValueError(f"budget auto: probe_nodes and fallback_after must be >= 1, got {probe_nodes}, "
                             f"{fallback_after}")
        self.max_nodes = int(max_nodes)
        self.costs = costs if costs is not None else CostTable.model()
        self.probe_every, self.probe_max = int(probe_every), int(probe_max)
        self.probe_nodes = int(probe_nodes)
        self.fallback_after = int(fallback_after)
        self.decay = float(decay)
        self.state: Dict[object, StreamBudgetState] = {}
        self.record = record
        self.steps: List[dict] = []
        self.step_index = 0
        self.rate: Optional[float] = None        # recent expected tokens per second of the chosen steps
        self._tok = self._sec = 0.0

    def _st(self, key) -> StreamBudgetState:
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = StreamBudgetState(Calibration(self.decay))
        return st

    def forget(self, key) -> None:
        """The stream left (its record stays in the statistics)."""
        st = self.state.get(key)
        if st is not None:
            st.fallback = st.probing = False

    # ---- per step ---------------------------------------------------------------------------------------
    def drafting(self, keys: Sequence) -> List:
        """The streams whose drafts this step's plan needs: those not in fall-back, and those whose probe is due."""
        out = []
        for k in keys:
            st = self._st(k)
            if not st.fallback or self.step_index + 1 >= st.next_probe:
                out.append(k)
        return out

    def plan(self, S: int, keys: Sequence, raw: Dict[object, np.ndarray]) -> Plan:
        """Budgets for the running streams ``keys`` of bucket S; ``raw[key]`` = the raw node probabilities of
        each drafted stream's tree at ``max_nodes`` (build order). Streams not in ``raw`` get 0 nodes."""
        self.step_index += 1
        n = len(keys)
        budgets = {k: 0 for k in keys}
        expected = {k: 1.0 for k in keys}
        if not raw:
            est = self.costs.root_s(S)
            p = Plan(budgets, False, expected, est, n / est, [])
            self._record(S, p)
            return p
        probes, forced, values = [], {}, []
        for order, k in enumerate(keys):
            if k not in raw:
                continue
            st = self._st(k)
            q = st.cal.correct(np.asarray(raw[k], np.float64)[:self.max_nodes])
            f = 0
            if st.fallback:                              # a due probe: it pays for probe_nodes nodes
                f = min(q.size, self.probe_nodes)
                probes.append(k)
            forced[k] = f
            for i in range(f, q.size):
                if q[i] > 0:
                    values.append((-q[i], order, i, k))
            expected[k] = 1.0 + float(q[:f].sum())
            budgets[k] = f
        values.sort()
        base_tokens = sum(expected.values())
        base_rows = n + sum(forced.values())
        lam = self.rate
        # objective: tokens - rate * seconds (the long-run ratio's Dinkelbach form, rate = the recent
        # tokens/s); before any history, the step's own ratio
        score = ((lambda tk, t: tk - lam * t) if lam is not None else (lambda tk, t: tk / t))
        tokens = base_tokens + np.concatenate([[0.0], np.cumsum([-v[0] for v in values])])
        secs = self.costs.draft_s(S, base_rows + np.arange(len(values) + 1))
        vals = score(tokens, secs)
        best_N = int(np.argmax(vals))                    # the first maximum: ties take fewer nodes
        best_v = float(vals[best_N])
        for negq, _, i, k in values[:best_N]:
            budgets[k] += 1
            expected[k] += -negq
        # drafting at all pays only if it beats a root-only step without the drafter; if not, every
        # drafted stream falls back (the draft of this step is already paid: its nodes are still used)
        root_v = score(float(n), self.costs.root_s(S))
        no_gain = not probes and best_v <= root_v
        est = self.costs.draft_s(S, n + sum(budgets.values()))
        p = Plan(budgets, True, expected, est, sum(expected.values()) / est, probes)
        # fall-back bookkeeping: a drafted stream that earns no node on fallback_after drafted steps in a
        # row stops drafting until its next probe
        for k in raw:
            st = self._st(k)
            if k in probes:
                st.probing = True                        # observe decides what the probe showed
                continue
            if not no_gain and budgets[k] > 0:
                st.idle, st.fallback, st.failed_probes, st.after_probe = 0, False, 0, False
                continue
            st.idle += 1
            if st.idle >= self.fallback_after:
                if st.after_probe:                       # the probe's stream earned nothing since: wait longer
                    st.failed_probes = min(st.failed_probes + 1, 30)
                st.idle, st.fallback, st.after_probe = 0, True, False
                self._schedule_probe(st)
        self._record(S, p)
        return p

    def _schedule_probe(self, st: StreamBudgetState) -> None:
        """The next probe: at least one wait from now, at a multiple of the wait (streams of equal wait
        probe in the same step)."""
        wait = min(self.probe_max, self.probe_every << st.failed_probes)
        st.next_probe = (self.step_index // wait + 2) * wait

    def observe(self, key, raw_p: np.ndarray, accepted_len: int) -> None:
        """After the verify: the raw probabilities of the stream's verified nodes (its budget's first values
        of ``plan``'s input) and the accepted length (root included)."""
        st = self._st(key)
        st.cal.observe(raw_p, int(accepted_len) - 1)
        st.realised.append(int(accepted_len))
        if st.probing:
            st.probing = False
            if accepted_len > 1:         # a hit: re-plan from the refreshed calibration next step (one
                st.fallback = False      # drafted step without earned nodes returns it to fall-back)
                st.after_probe = True
                st.idle = self.fallback_after - 1
            else:                        # nothing accepted: wait twice as long before the next probe
                st.failed_probes = min(st.failed_probes + 1, 30)     # reset when the stream earns nodes
                self._schedule_probe(st)
        if self.record and self.steps:
            self.steps[-1]["realised"][str(key)] = int(accepted_len)

    def note_root_only(self, key, accepted_len: int = 1) -> None:
        """A stream that ran root-only this step (no nodes to observe)."""
        self._st(key).realised.append(int(accepted_len))
        if self.record and self.steps:
            self.steps[-1]["realised"][str(key)] = int(accepted_len)

    # ---- statistics -------------------------------------------------------------------------------------
    def _record(self, S: int, p: Plan) -> None:
        self._tok = RATE_DECAY * self._tok + sum(p.expected.values())
        self._sec = RATE_DECAY * self._sec + p.est_s
        self.rate = self._tok / self._sec
        for k in p.budgets:
            st = self._st(k)
            st.budgets.append(int(p.budgets[k]))
            st.expected.append(float(p.expected[k]))
        if self.record:
            self.steps.append({"step": self.step_index, "bucket": int(S), "draft": bool(p.draft),
                               "budgets": {str(k): int(b) for k, b in p.budgets.items()},
                               "expected": {str(k): round(float(e), 4) for k, e in p.expected.items()},
                               "realised": {}, "probes": [str(k) for k in p.probes],
                               "est_step_ms": round(float(p.est_s) * 1e3, 4),
                               "est_tokens_per_s": round(float(p.est_tokens_per_s), 3)})

    def stats(self) -> dict:
        """What ``--json`` reports: per step (budgets, expected and realised accepted length per stream, the
        estimated tokens/s), per stream summaries, and the cost table's source."""
        per_stream = {}
        for k, st in self.state.items():
            m = min(len(st.expected), len(st.realised))
            per_stream[str(k)] = {
                "mean_budget": float(np.mean(st.budgets)) if st.budgets else 0.0,
                "mean_expected_accept": float(np.mean(st.expected[:m])) if m else 0.0,
                "mean_realised_accept": float(np.mean(st.realised[:m])) if m else 0.0,
                "root_only_steps": int(sum(1 for b in st.budgets if b == 0)),
                "steps": len(st.budgets)}
        est = [s["est_tokens_per_s"] for s in self.steps]
        return {"policy": "auto", "max_nodes": self.max_nodes, "cost_table": self.costs.source,
                "probe_every": self.probe_every, "probe_max": self.probe_max,
                "mean_est_tokens_per_s": float(np.mean(est)) if est else 0.0,
                "streams": per_stream, "steps": list(self.steps)}


def make_policy(budget, mode: str = "ddtree", include_chain: bool = False,
                costs: Optional[CostTable] = None) -> Optional[BudgetPolicy]:
    """The policy a ``budget`` argument asks for: None for an integer (a fixed budget), a new
    ``BudgetPolicy`` for 'auto' / 'auto:N' / ('auto', N), the given one for a ``BudgetPolicy``."""
    if isinstance(budget, BudgetPolicy):
        pol = budget
    else:
        b = budget if isinstance(budget, tuple) else parse_budget(budget)
        if isinstance(b, int):
            return None
        pol = BudgetPolicy(DEFAULT_MAX_NODES if b == "auto" else int(b[1]), costs=costs)
    if mode != "ddtree":
        raise ValueError(f"budget auto: only mode 'ddtree' builds trees of a chosen size (mode {mode!r})")
    if include_chain:
        raise ValueError("budget auto: include_chain is not supported (a forced chain breaks the prefix order "
                         "the policy cuts trees by)")
    return pol
