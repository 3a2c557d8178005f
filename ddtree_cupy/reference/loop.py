"""The decode loop in numpy: autoregressive, DFlash chain and DDTree decoding over several streams.

This is the specification of what the GPU engine decides each step; it makes the same decisions in the
same order, and reports the same statistics.

Per stream, state = (target KV cache with s committed tokens, drafter context cache, pending bonus b).
Prefill: the target runs the prompt (s = prompt length); the prompt's features become the drafter's
context; b = the target's choice after the prompt's last token.
One step, for every active stream:
  1. draft    the drafter proposes a block after b (logits for depths 1..D, D = block_size - 1)
  2. tree     per-depth top-K log-probs -> best-first tree of <= budget nodes -> flattened verify rows
              (mode 'chain': the rank-0 chain of D nodes; mode 'ar': no nodes, the root alone)
  3. verify   the target runs all rows in one pass (row 0 = b at position s, node rows at s + depth, each
              row sees the committed prefix plus its ancestors and itself)
  4. accept   post[i] = the target's argmax (temperature 0) or sample at row i; walk from the root while a
              child carries post[current]; accepted = root + walked nodes (tau = 1..block_size tokens);
              the target cache keeps the accepted rows at s..s+tau-1, their features join the drafter
              context, s += tau, b = post[last accepted].

Bonus-token policy: STREAM IMMEDIATELY. b is a final target choice (argmax or sample under its exact
prefix) the moment it is known, so it is emitted then: the first token right after prefill, and each step
emits the walked nodes plus the new bonus (tau tokens). Compared with emitting b only once it is committed
as the next root, the token sequence is identical; the first token arrives one step earlier and a stream
whose last token is the bonus (a stop id, or the max_new_tokens-th token) needs no extra verify pass.

Sampling (temperature > 0) is lossless: every emitted token is a genuine target sample under its exact
prefix. Randomness is Philox4x32-10 keyed by ``slot_seed(seed, sample_stream)`` with counter
``(step << 8) | row`` (``reference.ddtree.sample_tokens``, the GPU sampler's mapping); prefill draws with
step 0, decode step k with step k.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .ddtree import (MAX_DEPTH, MAX_RANK, MAX_TREE_ROWS, argmax_lowest, build_tree, commit_plan, flatten, greedy_walk,
                     sample_tokens, topk_logprobs)

from ..api import (MAX_BUDGET, MAX_TEMPERATURE, MIN_TEMPERATURE, MODES, PHASES, TOP_K_LIMIT, GenerationResult, Request, StepRecord,  # noqa: F401 (re-exported)
                   StreamState, emit_tokens)

assert MAX_BUDGET == MAX_TREE_ROWS - 1          # 128 tree nodes + the root


class DecodeLoop:
    """Runs requests to completion on a target (``ReferenceTarget`` interface) and, for 'chain'/'ddtree',
    a drafter with the interface: ``block_size``, ``target_layer_ids``, ``new_cache()``,
    ``append_context(cache, feats [T, F, H], positions [T], tokens [T])``, ``draft(cache, bonus, s) ->
    logits [block_size - 1, V]``."""

    def __init__(self, target, drafter=None, mode: str = "ddtree", budget=32,
                 cap_k: Optional[int] = None, include_chain: bool = False):
        """``budget``: an integer fixes every tree's node count; 'auto', ('auto', N) or a
        ``budget.BudgetPolicy`` chooses it per step and stream (mode 'ddtree' only, docs/BUDGET.md)."""
        if mode not in MODES:
            raise ValueError(f"mode: unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if mode != "ar" and drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter")
        from ..budget import make_policy
        self.policy = make_policy(budget, mode, include_chain) if mode == "ddtree" else None
        if self.policy is not None:
            budget = self.policy.max_nodes
        elif not isinstance(budget, (int, np.integer)):
            budget = 32 if mode != "ddtree" else budget     # 'chain' / 'ar' ignore the budget
        if not isinstance(budget, (int, np.integer)) or not 1 <= budget <= MAX_BUDGET:
            raise ValueError(f"budget: must be an integer in [1, {MAX_BUDGET}], got {budget!r}")
        if cap_k is not None and cap_k < 1:
            raise ValueError(f"cap_k: must be >= 1, got {cap_k}")
        self.target, self.drafter, self.mode = target, drafter, mode
        self.budget, self.cap_k, self.include_chain = int(budget), cap_k, bool(include_chain)
        self.vocab_size = target.cfg.vocab_size
        self.max_positions = target.cfg.max_position_embeddings
        if mode == "ar":
            self.capture: Tuple[int, ...] = ()
            self.depth = 0
        else:
            self.capture = tuple(drafter.target_layer_ids)
            self.depth = drafter.block_size - 1
            if not 1 <= self.depth <= MAX_DEPTH:
                raise ValueError(f"drafter block_size {drafter.block_size}: trees are built for at most "
                                 f"{MAX_DEPTH} draft depths (block_size <= {MAX_DEPTH + 1})")
        self.streams: List[StreamState] = []
        self.phase_s = {p: 0.0 for p in PHASES}
        self.step_count = 0
        self.records: List[StepRecord] = []

    # ---- decisions shared with the GPU engine -------------------------------------------------
    def tree_for(self, draft_logits: np.ndarray, budget: Optional[int] = None):
        """The draft tree of this mode from the drafter's logits [D, V]; ``budget`` (ddtree): this step's node
        budget for the stream when it is not the loop's own."""
        if self.mode == "chain":
            lp, ids = topk_logprobs(draft_logits, 1)
            return build_tree(lp, ids, self.depth)
        budget = self.budget if budget is None else int(budget)
        lp, ids = self.tree_topk(draft_logits, budget)
        return build_tree(lp, ids, budget, cap_k=self.cap_k, include_chain=self.include_chain)

    def tree_topk(self, draft_logits: np.ndarray, budget: Optional[int] = None):
        """Per-depth top-K (log-probs, ids) of mode 'ddtree': K = min(budget, V, MAX_RANK + 1, cap_k)."""
        k = min(self.budget if budget is None else int(budget), self.vocab_size, MAX_RANK + 1)
        if self.cap_k is not None:
            k = min(k, self.cap_k)
        return topk_logprobs(draft_logits, k)

    @staticmethod
    def choose(logits: np.ndarray, req: Request, step: int) -> np.ndarray:
        """The target's token at every row: argmax (ties -> lowest id) or a Philox-keyed sample."""
        if req.temperature <= 0:
            return argmax_lowest(logits)
        return sample_tokens(logits, req.temperature, req.top_p, req.top_k, int(req.seed), req.sample_stream, step)

    # ---- admission ----------------------------------------------------------------------------
    def add(self, req: Request) -> StreamState:
        """Validate and prefill one request; returns its stream (possibly already finished)."""
        req.validate(self.vocab_size, self.max_positions)
        t0 = time.perf_counter()
        prompt = np.asarray(list(req.prompt_ids), np.int64)
        P = prompt.shape[0]
        tcache = self.target.new_cache()
        logits, feats = self.target.forward(prompt, np.arange(P), tcache, capture_layers=self.capture)
        dcache = None
        if self.drafter is not None and self.mode != "ar":
            dcache = self.drafter.new_cache()
            self.drafter.append_context(dcache, feats, np.arange(P), prompt)
        bonus = int(self.choose(logits[-1:], req, 0)[0])
        st = StreamState(len(self.streams), req, tcache, dcache, committed=P, bonus=bonus)
        self.streams.append(st)
        emit_tokens(st, [bonus])
        self.phase_s["prefill"] += time.perf_counter() - t0
        return st

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Advance every active stream by one draft-verify-accept round."""
        for st in self.streams:
            # every verify row needs a RoPE position below the limit; a stream too close to it ends here
            if not st.done and st.committed + self.depth >= self.max_positions:
                st.finish_reason = "context"
        phase = {p: 0.0 for p in PHASES}
        done: List[Tuple[int, int, int, List[int]]] = []
        active = [st for st in self.streams if not st.done]
        if not active:
            return StepRecord(self.step_count, done, phase)    # nothing ran: not counted as a step
        self.step_count += 1
        if self.policy is not None:
            return self._step_auto(active, phase)
        for st in active:
            s = st.committed
            t0 = time.perf_counter()
            if self.mode == "ar":
                tokens, parents = np.array([st.bonus], np.int32), np.array([-1], np.int32)
                depths = np.zeros(1, np.int32)
                positions, visible, n_nodes = np.array([s]), None, 0
                t1 = t0
            else:
                dl = self.drafter.draft(st.drafter_cache, st.bonus, s)
                t1 = time.perf_counter()
                phase["draft"] += t1 - t0
                flat = flatten(self.tree_for(dl), st.bonus, s)
                tokens, parents, depths = flat.tokens, flat.parents, flat.depths
                positions, visible, n_nodes = flat.positions.astype(np.int64), flat.mask, flat.n_rows - 1
            phase["tree"] += time.perf_counter() - t1
            rows, emitted = self._verify_accept(st, tokens, parents, depths, positions, visible, n_nodes, phase)
            done.append((st.index, len(rows), n_nodes, emitted))
        for k, v in phase.items():
            self.phase_s[k] += v
        rec = StepRecord(self.step_count, done, phase)
        self.records.append(rec)
        return rec

    def _verify_accept(self, st: StreamState, tokens, parents, depths, positions, visible, n_nodes: int,
                       phase: Dict[str, float]):
        """Verify one stream's rows, walk, commit the accepted rows, emit. Returns (accepted rows, emitted)."""
        s = st.committed
        t2 = time.perf_counter()
        logits, feats = self.target.forward(tokens.astype(np.int64), positions, st.target_cache,
                                            visible=visible, capture_layers=self.capture)
        t3 = time.perf_counter()
        phase["verify"] += t3 - t2
        st.steps += 1
        post = self.choose(logits, st.request, st.steps)
        rows, new_bonus = greedy_walk(tokens, parents, post)
        plan = commit_plan(rows, depths, s)
        st.target_cache.commit(s, plan.src_slots)
        if st.drafter_cache is not None:
            self.drafter.append_context(st.drafter_cache, feats[plan.feature_rows],
                                        np.arange(s, plan.new_len), tokens[plan.feature_rows])
        st.committed, st.bonus = plan.new_len, new_bonus
        st.accept_lens.append(len(rows))
        st.tree_sizes.append(n_nodes)
        emitted = emit_tokens(st, [int(tokens[r]) for r in rows[1:]] + [new_bonus])
        phase["accept"] += time.perf_counter() - t3
        return rows, emitted

    def _step_auto(self, active: List[StreamState], phase: Dict[str, float]) -> StepRecord:
        """One step under the budget policy: draft the streams it asks for, build each one's tree at the
        largest budget, let the policy cut every tree to its budget (the first b nodes), then verify and
        accept as a fixed budget does; the policy observes what each tree realised."""
        pol = self.policy
        keys = [st.index for st in active]
        want = set(pol.drafting(keys))
        trees, raw = {}, {}
        from ..budget import path_values, truncate_tree
        for st in active:
            if st.index not in want:
                continue
            t0 = time.perf_counter()
            dl = self.drafter.draft(st.drafter_cache, st.bonus, st.committed)
            t1 = time.perf_counter()
            phase["draft"] += t1 - t0
            lp, ids = self.tree_topk(dl)
            trees[st.index] = build_tree(lp, ids, self.budget, cap_k=self.cap_k)
            raw[st.index] = path_values(lp, self.budget, self.cap_k)
            phase["tree"] += time.perf_counter() - t1
        plan = pol.plan(len(active), keys, raw)
        done: List[Tuple[int, int, int, List[int]]] = []
        for st in active:
            b = plan.budgets[st.index]
            if b > 0:
                flat = flatten(truncate_tree(trees[st.index], b), st.bonus, st.committed)
                tokens, parents, depths = flat.tokens, flat.parents, flat.depths
                positions, visible, n_nodes = flat.positions.astype(np.int64), flat.mask, flat.n_rows - 1
            else:
                tokens, parents = np.array([st.bonus], np.int32), np.array([-1], np.int32)
                depths, positions, visible, n_nodes = np.zeros(1, np.int32), np.array([st.committed]), None, 0
            rows, emitted = self._verify_accept(st, tokens, parents, depths, positions, visible, n_nodes, phase)
            if n_nodes:
                pol.observe(st.index, raw[st.index][:n_nodes], len(rows))
            else:
                pol.note_root_only(st.index, len(rows))
            if st.done:
                pol.forget(st.index)
            done.append((st.index, len(rows), n_nodes, emitted))
        for k, v in phase.items():
            self.phase_s[k] += v
        rec = StepRecord(self.step_count, done, phase)
        self.records.append(rec)
        return rec

    @property
    def active(self) -> bool:
        return any(not s.done for s in self.streams)

    def run(self, requests: Sequence[Request],
            on_tokens: Optional[Callable[[StreamState, List[int]], None]] = None) -> GenerationResult:
        """Prefill every request, then step until all are finished. ``on_tokens(stream, ids)`` sees every
        emitted token as soon as it exists (streaming output)."""
        for r in requests:           # validate all before spending time on any
            r.validate(self.vocab_size, self.max_positions)
        t_start = time.perf_counter()
        for r in requests:
            st = self.add(r)
            if on_tokens:
                on_tokens(st, list(st.output_ids))
        t_dec = time.perf_counter()
        while self.active:
            rec = self.step()
            if on_tokens:
                for idx, _, _, em in rec.streams:
                    if em:
                        on_tokens(self.streams[idx], em)
        t_end = time.perf_counter()
        acc = [a for rec in self.records for (_, a, _, _) in rec.streams]
        sizes = [n for rec in self.records for (_, _, n, _) in rec.streams]
        return GenerationResult(list(self.streams), self.step_count, acc, sizes, dict(self.phase_s),
                                t_end - t_start, t_end - t_dec,
                                self.policy.stats() if self.policy is not None else None)


def generate(target, drafter, requests: Sequence[Request], mode: str = "ddtree", budget=32,
             cap_k: Optional[int] = None, include_chain: bool = False,
             on_tokens: Optional[Callable] = None) -> GenerationResult:
    """One-call convenience: a fresh ``DecodeLoop`` run over ``requests``."""
    return DecodeLoop(target, drafter, mode, budget, cap_k, include_chain).run(requests, on_tokens)
