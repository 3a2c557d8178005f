"""Host-side scheduling for both engines: admission, continuous batching, slots, stop handling, cancellation.

Everything here is plain Python over numpy (no GPU), so it is tested on any machine
(tests/test_scheduler.py). The GPU engine asks it, between decode steps:

* ``admit()``        which waiting requests get a stream slot now (they are then prefilled). A request
                     whose KV reservation can never fit (longer than one stream may hold, or than the
                     whole pool) is finished at once with ``finish_reason = 'error'`` and KVPoolFull's
                     message in ``stream.error``; the others keep running. A request that only has to
                     wait (pool or slots busy) stays queued, first come first served.
* ``end_context()``  which running streams must stop because the next round's deepest verify row would
                     reach ``max_position_embeddings`` (the reference loop's 'context' rule).
* ``cancel()``       end a stream whose client went away: out of the queue, or out of its slot (pages
                     released; the loop calls it only at a step boundary).
* ``running()``      the running streams, by slot; ``bucket_for`` the graph's stream bucket.
* ``after_prefill`` / ``after_step``  record what the GPU produced: emit tokens (cut at a stop id or
                     ``max_new_tokens``, exactly like ``reference.loop.DecodeLoop``), advance the committed
                     length and the pending bonus, and release the slot's pages when the stream ends.

Slots are the KV pool's: the lowest free slot is handed out first, so with ``b`` running streams the
slots in use are usually ``0 .. b-1`` and the smallest graph bucket covering the highest slot in use is
small. The engine's stream index of the KV pool, the drafter cache and the graph's batch row are all this
one slot number.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence

import numpy as np

from ..api import (CTRL_ACTIVE, CTRL_BONUS, CTRL_BUDGET, CTRL_FIELDS, CTRL_PREFIX, CTRL_STEP,  # noqa: F401
                   OUT_NACC, OUT_NROWS, OUT_TOKENS, Request, StreamState, emit_tokens)
from .kv_pool import KVPool, KVPoolFull

DEFAULT_BUCKETS = (1, 2, 4, 8, 10)


@dataclass
class EngineStream(StreamState):
    """A reference ``StreamState`` plus where it lives on the GPU. ``target_cache``/``drafter_cache`` stay
    None (the caches are the engine's pools, indexed by ``slot``)."""
    slot: int = -1
    prompt_len: int = 0


def bucket_for(max_slot: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding slots 0..max_slot."""
    for b in sorted(buckets):
        if b > max_slot:
            return b
    raise ValueError(f"slot {max_slot}: no stream bucket is large enough (buckets {tuple(buckets)})")


def make_buckets(max_streams: int, base: Sequence[int] = DEFAULT_BUCKETS) -> tuple:
    """Bucket sizes up to max_streams (max_streams itself is always one)."""
    if max_streams < 1:
        raise ValueError(f"max_streams: must be >= 1, got {max_streams}")
    return tuple(sorted({b for b in base if b < max_streams} | {max_streams}))


class Scheduler:
    """Admission and per-stream bookkeeping for one ``generate`` call.

    ``depth``: the draft depth D of the mode (0 for 'ar'): a round writes rows up to s + depth positions.
    ``keep_history``: keep every stream and every accepted length (a batch run's result); a server runs with
    False so that nothing grows with the number of requests served. ``on_release(stream)`` runs when a
    stream leaves its slot (the numpy executor drops its caches there).
    """

    def __init__(self, pool: KVPool, vocab_size: int, max_positions: int, depth: int, keep_history: bool = True,
                 on_release=None):
        self.pool = pool
        self.vocab_size, self.max_positions, self.depth = vocab_size, max_positions, depth
        self.keep_history = bool(keep_history)
        self.on_release = on_release
        self.n_submitted = 0
        self.streams: List[EngineStream] = []
        self.waiting: Deque[EngineStream] = deque()
        self.by_slot: Dict[int, EngineStream] = {}
        self.accept_lens: List[int] = []
        self.tree_sizes: List[int] = []
        self.steps = 0
        self.table_dirty = True          # the device block table needs a refresh

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> List[EngineStream]:
        """Validate every request (ValueError before anything runs, like the reference loop), then queue."""
        for r in requests:
            r.validate(self.vocab_size, self.max_positions)
        new = []
        for r in requests:
            st = EngineStream(self.n_submitted, r, None, None, committed=0, bonus=-1,
                              prompt_len=len(list(r.prompt_ids)))
            self.n_submitted += 1
            if self.keep_history:
                self.streams.append(st)
            self.waiting.append(st)
            new.append(st)
        return new

    def never_fits(self, request: Request) -> Optional[str]:
        """Why ``request`` can never be admitted (its reservation exceeds a stream's or the pool's pages),
        or None. Depends only on the pool's fixed sizes, so any thread may ask."""
        st = EngineStream(-1, request, None, None, committed=0, bonus=-1, prompt_len=len(list(request.prompt_ids)))
        why = self._never_fits(st)
        # the pool names the request by its probe id: a stream that does not exist yet means nothing to a client
        return why.split(": ", 1)[1] if why is not None and why.startswith("request (") else why

    def cancel(self, st: EngineStream, reason: str = "cancelled") -> bool:
        """End ``st`` with ``reason`` (queued: dropped; running: its slot and pages released now). Returns
        False when it had already finished."""
        if st.done:
            return False
        st.finish_reason = reason
        if st in self.waiting:
            self.waiting.remove(st)
        else:
            self._release(st)
        return True

    def reserve_new_tokens(self, st: EngineStream) -> int:
        """Tokens to reserve beyond the prompt: max_new_tokens, but never past the position limit (a stream
        ends with 'context' before its verify rows reach it; the pool adds the tree rows on top)."""
        return max(1, min(int(st.request.max_new_tokens), self.max_positions - st.prompt_len))

    def _never_fits(self, st: EngineStream) -> Optional[str]:
        need = self.pool.pages_needed(st.prompt_len, self.reserve_new_tokens(st))
        if need > self.pool.max_pages_per_stream or need > self.pool.num_pages:
            try:                           # KVPoolFull's own message (it changes nothing when it raises)
                self.pool.admit(("probe", st.index), st.prompt_len, self.reserve_new_tokens(st))
            except KVPoolFull as e:
                if need > self.pool.num_pages and need <= self.pool.max_pages_per_stream:
                    return (f"{e}; the whole pool holds {self.pool.num_pages} pages, so this request can never "
                            f"be admitted")
                return str(e)
            raise AssertionError("KV pool admitted a request larger than its limits")
        return None

    def admit(self) -> List[EngineStream]:
        """Move waiting requests into free slots (first come first served). Returns the admitted streams,
        in order; refused ones are finished with 'error' and not returned."""
        admitted = []
        while self.waiting:
            st = self.waiting[0]
            why = self._never_fits(st)
            if why is not None:
                self.waiting.popleft()
                st.finish_reason, st.error = "error", why
                continue
            try:
                slot = self.pool.admit(st.index, st.prompt_len, self.reserve_new_tokens(st))
            except KVPoolFull:
                if not self.by_slot:       # nothing will ever free pages: cannot happen after _never_fits
                    raise
                break                      # wait for a running stream to finish
            self.waiting.popleft()
            st.slot = slot
            self.by_slot[slot] = st
            self.table_dirty = True
            admitted.append(st)
        return admitted

    # ---- per round -----------------------------------------------------------------------------
    def end_context(self) -> List[EngineStream]:
        """Finish running streams whose next round would reach the position limit ('context')."""
        ended = []
        for slot in sorted(self.by_slot):
            st = self.by_slot[slot]
            if st.committed + self.depth >= self.max_positions:
                st.finish_reason = "context"
                ended.append(st)
        for st in ended:
            self._release(st)
        return ended

    def running(self) -> List[EngineStream]:
        return [self.by_slot[s] for s in sorted(self.by_slot)]

    @property
    def busy(self) -> bool:
        return bool(self.by_slot) or bool(self.waiting)

    def after_prefill(self, st: EngineStream, bonus: int) -> List[int]:
        """The prompt is in the caches and the target chose ``bonus``: emit it (it may end the stream)."""
        st.committed, st.bonus = st.prompt_len, int(bonus)
        em = emit_tokens(st, [int(bonus)])
        if st.done:
            self._release(st)
        return em

    def begin_step(self) -> None:
        self.steps += 1

    def after_step(self, st: EngineStream, n_acc: int, tokens: Sequence[int], n_nodes: int) -> List[int]:
        """A round accepted ``n_acc`` rows; ``tokens`` = the accepted tokens (root = the old bonus first),
        then the new bonus at index n_acc (walk_commit's out_tokens). Returns the emitted tokens."""
        if not 1 <= n_acc <= len(tokens) - 1:
            raise ValueError(f"stream {st.index}: accepted length {n_acc} outside [1, {len(tokens) - 1}]")
        if int(tokens[0]) != st.bonus:
            raise AssertionError(f"stream {st.index}: the round's root token {int(tokens[0])} is not the "
                                 f"pending bonus {st.bonus}")
        st.steps += 1
        st.committed += int(n_acc)
        st.bonus = int(tokens[n_acc])
        st.accept_lens.append(int(n_acc))
        st.tree_sizes.append(int(n_nodes))
        if self.keep_history:
            self.accept_lens.append(int(n_acc))
            self.tree_sizes.append(int(n_nodes))
        em = emit_tokens(st, [int(t) for t in tokens[1:n_acc]] + [st.bonus])
        if st.done:
            self._release(st)
        return em

    def _release(self, st: EngineStream) -> None:
        if st.slot in self.by_slot and self.by_slot[st.slot] is st:
            del self.by_slot[st.slot]
            self.pool.release(st.slot)
            self.table_dirty = True
            if self.on_release is not None:
                self.on_release(st)


def pack_control(running: Sequence[EngineStream], bucket: int, budget) -> np.ndarray:
    """The per-step control block the host uploads before a replay: int32 [CTRL_FIELDS, bucket] rows
    (prefix_len, bonus, active, budget, step). ``budget``: one int for every stream, or one per stream of
    ``running`` (the loop's per-step choice). Idle slots: active 0, budget 0, prefix 0, bonus 0."""
    budgets = [int(budget)] * len(running) if np.ndim(budget) == 0 else [int(b) for b in budget]
    if len(budgets) != len(running):
        raise ValueError(f"pack_control: {len(budgets)} budgets for {len(running)} running streams")
    ctrl = np.zeros((CTRL_FIELDS, bucket), np.int32)
    for st, b in zip(running, budgets):
        if st.slot >= bucket:
            raise ValueError(f"stream {st.index}: slot {st.slot} outside the bucket of {bucket}")
        ctrl[CTRL_PREFIX, st.slot] = st.committed
        ctrl[CTRL_BONUS, st.slot] = st.bonus
        ctrl[CTRL_ACTIVE, st.slot] = 1
        ctrl[CTRL_BUDGET, st.slot] = b
        ctrl[CTRL_STEP, st.slot] = st.steps + 1      # the round about to run (sampling counter)
    return ctrl


def unpack_row(row: np.ndarray):
    """One slot's row of the step's packed output (``api.OUT_*`` layout): (n_acc, n_rows, out_tokens)."""
    return int(row[OUT_NACC]), int(row[OUT_NROWS]), row[OUT_TOKENS:]
