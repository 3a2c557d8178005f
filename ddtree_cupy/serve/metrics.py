"""The server's Prometheus metrics (``GET /metrics``), fed by the engine loop and the request handlers.

Requests by outcome; queue depth, running streams, KV pages used / free; time to first token, inter-token
latency and end-to-end latency histograms; prompt and generated tokens; the speculative statistics per
decode step (accepted length per stream, tree size, draft / tree / verify / accept phase seconds) and the
recent generation rate. One registry per server, so tests may run several.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.loop import Handle, LoopObserver

P = "ddtree_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics(LoopObserver):
    def __init__(self, pool=None):
        self.pool = pool
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "requests by outcome (finish reason, or refused_<why>, "
                                "or client_disconnected)", ["outcome"], registry=r)
        self.queue = Gauge(P + "queue_depth", "requests waiting for a stream slot", registry=r)
        self.running = Gauge(P + "running_streams", "streams in the running batch", registry=r)
        self.kv_used = Gauge(P + "kv_pages_used", "KV cache pages reserved by running streams", registry=r)
        self.kv_free = Gauge(P + "kv_pages_free", "free KV cache pages", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "first to last token / (tokens - 1), per request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "request_latency_seconds", "submission to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.gen_tokens = Counter(P + "generation_tokens", "tokens generated", registry=r)
        self.tps = Gauge(P + "generation_tokens_per_second", "tokens accepted per second over the last 10 s",
                         registry=r)
        self.steps = Counter(P + "decode_steps", "decode steps run", registry=r)
        self.accept = Histogram(P + "accept_length", "tokens accepted per stream per step (root + walked nodes)",
                                buckets=tuple(range(1, 17)), registry=r)
        self.tree = Histogram(P + "tree_size", "tree nodes per stream per step (root excluded)",
                              buckets=(0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128), registry=r)
        self.phase = Histogram(P + "step_phase_seconds", "seconds per decode-step phase", ["phase"],
                               buckets=STEP_BUCKETS, registry=r)
        self._recent: deque = deque()
        self._lock = threading.Lock()

    # ---- from the loop thread -------------------------------------------------------------------------
    def on_step(self, running, queued, accept_lens, tree_sizes, phase_s) -> None:
        self.steps.inc()
        self.running.set(running)
        self.queue.set(queued)
        for a in accept_lens:
            self.accept.observe(a)
        for n in tree_sizes:
            self.tree.observe(n)
        for k, v in phase_s.items():
            self.phase.labels(k).observe(v)
        n = sum(accept_lens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
        self._pages()

    def on_finish(self, h: Handle) -> None:
        self.requests.labels(h.stream.finish_reason).inc()
        n = len(h.stream.output_ids)
        if h.first_token_t is not None:
            self.ttft.observe(h.first_token_t - h.submitted_t)
            if n > 1:
                self.itl.observe((h.finish_t - h.first_token_t) / (n - 1))
        self.e2e.observe(h.finish_t - h.submitted_t)
        self.prompt_tokens.inc(len(h.request.prompt_ids))
        self.gen_tokens.inc(n)
        self._pages()

    # ---- from the handlers --------------------------------------------------------------------------
    def refused(self, kind: str) -> None:
        self.requests.labels(f"refused_{kind}").inc()

    def render(self, loop) -> bytes:
        self.running.set(loop.running)
        self.queue.set(loop.queued)
        self._pages()
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            self.tps.set(sum(n for _, n in self._recent) / 10.0)
        return generate_latest(self.registry)

    def _pages(self) -> None:
        if self.pool is not None:
            self.kv_free.set(self.pool.free_pages)
            self.kv_used.set(self.pool.num_pages - self.pool.free_pages)
