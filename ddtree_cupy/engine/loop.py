"""The online engine loop: the one decode loop of every engine, every client and every rank.

Clients (the HTTP server's handlers, the batch CLI) call ``submit`` / ``cancel`` from any thread at any
time; one loop thread calls ``iterate`` over and over. One iteration, read top to bottom:

  1. exchange   rank 0 takes what clients asked since the last step (new requests, cancellations, stop)
                and broadcasts it, so every tensor-parallel rank applies the same decisions in the same
                order (``LoopControl``). With nothing running and nothing asked, rank 0 waits here.
  2. apply      new requests join the scheduler's FCFS queue; cancelled streams leave (queued: dropped;
                running: slot and KV pages released now, at the step boundary).
  3. admit      queued requests that fit take a slot and reserve their KV pages; each is prefilled and its
                first token (the prefill's bonus) is delivered. One that can never fit ends with 'error'.
  4. context    running streams whose next verify round would pass the position limit end ('context').
  5. budgets    ``decide_budgets``: this step's DDTree node budget per running stream (the one place a
                budget policy plugs in; by default the engine's budget for all).
  6. step       the executor runs one draft / tree / verify / accept round over all running streams.
  7. deliver    accepted tokens go to each stream's client as soon as they exist; finished streams free
                their slot and pages and their clients get the finish reason.

An executor (``backend.NumpyExecutor``, ``gpu_engine._Executor``) provides ``write_block_table(table)``,
``prefill(stream) -> bonus``, ``step(running, bucket, budgets) -> int32 [bucket, 2 + A + 1]`` (per slot:
n_acc, n_rows, out tokens; ``api.OUT_*``), a ``phase_s`` dict it adds phase seconds to, and ``dev_budget``
(the node budget its steps are built for). The scheduler (``engine/scheduler.py``) owns admission, slots
and the stop rule; this module only orders the stages and talks to clients.

Refusals are immediate: ``submit`` raises ``api.Refused`` for an invalid request, one whose KV reservation
can never fit, or one arriving when ``max_streams + max_queue`` requests are already in the system.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..api import GenerationResult, Refused, Request, StreamState
from .scheduler import Scheduler, bucket_for, unpack_row

# sink(handle, new_tokens, finish_reason): called on the loop thread after every emission; finish_reason is
# set exactly once, on the last call (possibly with no tokens).
Sink = Callable[["Handle", List[int], Optional[str]], None]


class Handle:
    """A submitted request as its client sees it. ``stream`` is the scheduler's stream (set on the loop
    thread when the request joins the queue); ``finished`` is set once the stream has ended."""

    def __init__(self, hid: int, request: Request, sink: Optional[Sink] = None):
        self.id, self.request, self.sink = hid, request, sink
        self.stream: Optional[StreamState] = None
        self.finished = threading.Event()
        self.submitted_t = time.perf_counter()
        self.first_token_t: Optional[float] = None
        self.finish_t: Optional[float] = None

    @property
    def output_ids(self) -> List[int]:
        return list(self.stream.output_ids) if self.stream is not None else []

    @property
    def finish_reason(self) -> Optional[str]:
        return self.stream.finish_reason if self.stream is not None else None


@dataclass
class LoopControl:
    """What rank 0 broadcasts before each iteration: requests to queue (in arrival order), (id, reason) of
    streams to end, and whether the loop ends."""
    new: List[Tuple[int, Request]] = field(default_factory=list)
    cancel: List[Tuple[int, str]] = field(default_factory=list)
    stop: bool = False


class LoopObserver:
    """Hooks the loop calls on its own thread (the server's metrics); every method is optional to override."""

    def on_step(self, running: int, queued: int, accept_lens: Sequence[int], tree_sizes: Sequence[int],
                phase_s: Dict[str, float]) -> None:
        pass

    def on_finish(self, handle: Handle) -> None:
        pass


class EngineLoop:
    def __init__(self, executor, sched: Scheduler, buckets: Sequence[int], comm=None,
                 max_queue: Optional[int] = None, observer: Optional[LoopObserver] = None):
        from ..dist import SingleRank
        if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"EngineLoop: max_queue must be an integer >= 0 or None, got {max_queue!r}")
        self.executor, self.sched, self.buckets = executor, sched, tuple(buckets)
        self.comm = comm if comm is not None else SingleRank()
        self.max_streams = sched.pool.max_streams
        self.max_queue = max_queue
        self.observer = observer or LoopObserver()
        self._lock = threading.Condition()
        self._inbox: Deque[Tuple[int, Request]] = deque()
        self._cancels: List[Tuple[int, str]] = []
        self._stop = False
        self._next_id = 0
        self._in_system = 0                 # submitted and not finished (rank 0's admission count)
        self._live: Dict[int, Handle] = {}  # id -> handle of every unfinished request this rank knows
        self._by_stream: Dict[int, Handle] = {}
        self.steps = 0
        self._record: Optional[List[Handle]] = None
        self.error: Optional[BaseException] = None   # set when the loop thread died

    # ---- client side (rank 0, any thread) ----------------------------------------------------------------
    def submit(self, request: Request, sink: Optional[Sink] = None) -> Handle:
        """Queue ``request``; raises ``Refused`` at once when it can never run or the queue is full."""
        try:
            request.validate(self.sched.vocab_size, self.sched.max_positions)
        except ValueError as e:
            raise Refused("invalid", str(e)) from None
        why = self.sched.never_fits(request)
        if why is not None:
            raise Refused("too_long", why)
        with self._lock:
            if self._stop or self.error is not None:
                raise Refused("shutdown", "the engine loop is not running")
            if self.max_queue is not None and self._in_system >= self.max_streams + self.max_queue:
                raise Refused("queue_full", f"{self._in_system} requests are running or queued (limit "
                                            f"{self.max_streams} running + {self.max_queue} queued); retry later")
            return self._enqueue(request, sink)

    def _enqueue(self, request: Request, sink: Optional[Sink]) -> Handle:
        h = Handle(self._next_id, request, sink)
        self._next_id += 1
        self._in_system += 1
        self._live[h.id] = h
        self._inbox.append((h.id, request))
        self._lock.notify_all()
        return h

    def cancel(self, handle: Handle, reason: str = "cancelled") -> None:
        """Ask for ``handle``'s stream to end with ``reason`` ('cancelled': its client went away; 'stop': the
        client matched a stop string); its pages are released at the next step boundary."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"cancel: reason must be 'cancelled' or 'stop', got {reason!r}")
        with self._lock:
            if not handle.finished.is_set():
                self._cancels.append((handle.id, reason))
                self._lock.notify_all()

    def stop(self) -> None:
        """End the loop after the current iteration (unfinished streams end 'cancelled')."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()

    @property
    def queued(self) -> int:
        return len(self.sched.waiting) + len(self._inbox)

    @property
    def running(self) -> int:
        return len(self.sched.by_slot)

    # ---- the loop (every rank) --------------------------------------------------------------------------
    def run(self) -> None:
        """Iterate until stopped (the loop thread's body). An exception ends every stream with 'error',
        refuses new requests and is re-raised (under mpirun the caller's guard then ends the job)."""
        try:
            while self.iterate(until_idle=False):
                pass
        except BaseException as e:  # noqa: BLE001 - clients must learn that the loop is gone
            self.error = e
            self._fail_all(f"engine failure: {type(e).__name__}: {e}")
            raise

    def iterate(self, until_idle: bool) -> bool:
        """One pass of the stages in the module docstring. Returns False when the loop has ended.
        ``until_idle``: end when nothing is running, queued or asked for (the batch client)."""
        ctrl = self._exchange(until_idle)                                   # 1. exchange
        self._apply(ctrl)                                                   # 2. apply
        if ctrl.stop:                   # every unfinished stream ends 'cancelled'; its client is told
            for h in list(self._live.values()):
                if h.stream is not None:
                    self.sched.cancel(h.stream)
            self._settle()
            return False
        self._admit()                                                       # 3. admit (+ prefill)
        self.sched.end_context()                                            # 4. context
        self._settle()
        running = self.sched.running()
        if not running:
            return True
        budgets = self.decide_budgets(running)                              # 5. budgets
        self._step(running, budgets)                                        # 6. step, 7. deliver
        self._settle()
        return True

    def decide_budgets(self, running: Sequence[StreamState]) -> List[int]:
        """This step's node budget for each running stream, in ``running``'s order (each at most the
        executor's ``dev_budget``, which its step buffers are sized for). The one place a per-step budget
        policy belongs; today every stream gets the engine's budget."""
        return [self.executor.dev_budget] * len(running)

    # ---- stages -----------------------------------------------------------------------------------------
    def _exchange(self, until_idle: bool) -> LoopControl:
        if self.comm.rank == 0:
            with self._lock:
                while not (self._inbox or self._cancels or self._stop or self.sched.busy or until_idle):
                    self._lock.wait(timeout=1.0)
                ctrl = LoopControl(list(self._inbox), list(self._cancels), self._stop)
                self._inbox.clear()
                self._cancels.clear()
                if until_idle and not (ctrl.new or self.sched.busy or self._in_system):
                    ctrl.stop = True
        else:
            ctrl = None
        if self.comm.size > 1:
            ctrl = self.comm.broadcast_obj(ctrl)
        return ctrl

    def _apply(self, ctrl: LoopControl) -> None:
        for hid, req in ctrl.new:
            h = self._live.get(hid)
            if h is None:                  # another rank's copy of rank 0's request
                h = Handle(hid, req)
                self._live[hid] = h
            (st,) = self.sched.submit([req])
            h.stream = st
            self._by_stream[st.index] = h
            if self._record is not None:
                self._record.append(h)
        for hid, reason in ctrl.cancel:
            h = self._live.get(hid)
            if h is not None and h.stream is not None:
                self.sched.cancel(h.stream, reason)

    def _admit(self) -> None:
        ex, sched = self.executor, self.sched
        for st in sched.admit():
            if sched.table_dirty:
                ex.write_block_table(sched.pool.block_table)
                sched.table_dirty = False
            t0 = time.perf_counter()
            bonus = ex.prefill(st)
            ex.phase_s["prefill"] = ex.phase_s.get("prefill", 0.0) + time.perf_counter() - t0
            self._deliver(st, sched.after_prefill(st, bonus))

    def _step(self, running: List[StreamState], budgets: List[int]) -> None:
        ex, sched = self.executor, self.sched
        if sched.table_dirty:
            ex.write_block_table(sched.pool.block_table)
            sched.table_dirty = False
        bucket = bucket_for(running[-1].slot, self.buckets)
        before = dict(ex.phase_s)
        sched.begin_step()
        self.steps += 1
        out = ex.step(running, bucket, budgets)
        acc, sizes = [], []
        for st in running:
            n_acc, n_rows, toks = unpack_row(out[st.slot])
            self._deliver(st, sched.after_step(st, n_acc, toks, n_rows - 1))
            acc.append(n_acc)
            sizes.append(n_rows - 1)
        phase = {k: v - before.get(k, 0.0) for k, v in ex.phase_s.items() if v != before.get(k, 0.0)}
        self.observer.on_step(len(running), len(sched.waiting), acc, sizes, phase)

    def _deliver(self, st: StreamState, tokens: List[int]) -> None:
        h = self._by_stream.get(st.index)
        if h is None or not tokens:
            return
        if h.first_token_t is None:
            h.first_token_t = time.perf_counter()
        if h.sink is not None:
            h.sink(h, tokens, None)

    def _settle(self) -> None:
        """Hand every newly finished stream's finish reason to its client and forget the stream."""
        for idx, h in list(self._by_stream.items()):
            if h.stream.done:
                del self._by_stream[idx]
                self._finish(h)

    def _finish(self, h: Handle) -> None:
        h.finish_t = time.perf_counter()
        self._live.pop(h.id, None)
        with self._lock:
            self._in_system -= 1
        if h.sink is not None:
            h.sink(h, [], h.stream.finish_reason)
        h.finished.set()
        self.observer.on_finish(h)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._inbox.clear()
        for h in list(self._live.values()):
            if h.stream is None:
                h.stream = StreamState(h.id, h.request, None, None, 0, -1)
            if not h.stream.done:
                h.stream.finish_reason, h.stream.error = "error", message
            self._by_stream.pop(h.stream.index, None)
            self._finish(h)

    # ---- the batch client -------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request],
                 on_tokens: Optional[Callable[[StreamState, List[int]], None]] = None) -> GenerationResult:
        """Run ``requests`` to completion on this thread and return them in order. Every request is
        validated first (ValueError before anything runs); one whose KV reservation can never fit ends with
        'error' and its reason while the others run. Under mpirun rank 0's requests are the ones run (every
        rank calls this; the others learn the requests through the exchange). ``on_tokens(stream, ids)``
        sees every emitted token as soon as it exists."""
        for r in requests:
            r.validate(self.sched.vocab_size, self.sched.max_positions)
        t_start = time.perf_counter()
        sink = (lambda h, toks, fin: on_tokens(h.stream, toks) if toks else None) if on_tokens else None
        if self.comm.rank == 0:
            with self._lock:
                for r in requests:
                    self._enqueue(r, sink)
        ex = self.executor
        t_dec = [0.0]
        prefill0 = ex.phase_s.get("prefill", 0.0)
        acc: List[int] = []
        sizes: List[int] = []

        class _Collect(LoopObserver):
            def on_step(_, running, queued, accept_lens, tree_sizes, phase_s):
                acc.extend(accept_lens)
                sizes.extend(tree_sizes)

        saved, self.observer = self.observer, _Collect()
        steps0 = self.steps
        self._record = []                   # every handle _apply queues, in order (on every rank)
        try:
            while self.iterate(until_idle=True):
                pass
        finally:
            self.observer = saved
            handles, self._record = self._record, None
        t_end = time.perf_counter()
        t_dec[0] = (t_end - t_start) - (ex.phase_s.get("prefill", 0.0) - prefill0)
        return GenerationResult([h.stream for h in handles], self.steps - steps0, acc, sizes, dict(ex.phase_s),
                                t_end - t_start, t_dec[0])
