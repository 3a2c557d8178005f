"""Shared set-up of the server tests: in-process servers on 127.0.0.1 over the demo checkpoint (numpy
backend), or over a scripted executor that emits given token ids through the real loop, tokenizer and
parsers (fast, and able to produce reasoning and tool-call output a random tiny model never writes)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from ddtree_cupy.api import OUT_NACC, OUT_NROWS, OUT_TOKENS
from ddtree_cupy.dist import SingleRank
from ddtree_cupy.engine.kv_pool import KVPool
from ddtree_cupy.engine.loop import EngineLoop
from ddtree_cupy.engine.scheduler import Scheduler, make_buckets
from ddtree_cupy.serve.app import ServerState
from ddtree_cupy.serve.main import LocalServer, build_parser, build_state
from ddtree_cupy.serve.metrics import ServerMetrics

MODEL = "ddtree-demo"


def demo_state(*extra: str):
    a = build_parser().parse_args(["--demo", "--backend", "numpy", *extra])
    return build_state(a, SingleRank(), log=lambda line: None)


class ScriptedExecutor:
    """The executor interface of engine/loop.py, emitting for each request the script chosen by the
    ``script:NAME`` marker in its prompt text, 1..3 tokens per step (a per-request random pattern).
    ``step_sleep``: seconds per step (to hold streams in the system for the queue tests)."""

    def __init__(self, tok, scripts, step_sleep: float = 0.0, seed: int = 0):
        self.tok, self.scripts, self.step_sleep = tok, scripts, step_sleep
        self.phase_s = {}
        self.dev_budget = 4
        self.rng = np.random.default_rng(seed)
        self.ids = {}
        self.released = []

    def script_for(self, request):
        text = self.tok.decode(list(request.prompt_ids))
        m = re.search(r"script:([A-Za-z0-9_]+)", text)
        return self.scripts[m.group(1) if m else "default"]

    def write_block_table(self, table):
        pass

    def release(self, st):
        self.released.append(st.index)

    def prefill(self, st):
        self.ids[st.index] = self.script_for(st.request)
        return self.ids[st.index][0]

    def step(self, running, bucket, budgets):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.phase_s["verify"] = self.phase_s.get("verify", 0.0) + 1e-4
        out = np.full((bucket, OUT_TOKENS + 8), -1, np.int32)
        out[:, OUT_NACC] = 0
        for st in running:
            script = self.ids[st.index]
            pos = len(st.output_ids)
            m = int(self.rng.integers(1, 4))
            chunk = script[pos:pos + m] or [script[-1]]
            toks = [st.bonus] + chunk
            out[st.slot, OUT_NACC], out[st.slot, OUT_NROWS] = len(chunk), len(chunk) + 3
            out[st.slot, OUT_TOKENS:OUT_TOKENS + len(toks)] = toks
        return out


def scripted_state(tok, scripts, max_streams=4, max_queue=16, num_pages=64, pages_per_stream=8,
                   max_positions=4096, step_sleep=0.0, api_key=None):
    ex = ScriptedExecutor(tok, scripts, step_sleep)
    pool = KVPool(num_pages, 64, max_streams, pages_per_stream, ex.dev_budget + 1)
    metrics = ServerMetrics(pool)
    sched = Scheduler(pool, tok.vocab_size, max_positions, 8, keep_history=False, on_release=ex.release)
    loop = EngineLoop(ex, sched, make_buckets(max_streams), max_queue=max_queue, observer=metrics)
    return ServerState(loop, tok, tok.vocab_size, max_positions, MODEL, metrics, api_key, 4096, "scripted",
                       "ddtree")


def script_ids(tok, text: str, stop: bool = True):
    """Ids of ``text`` with Kimi's tags as special ids where the tokenizer has them, then <|im_end|>."""
    ids = tok.encode(text, allow_special=True)
    return ids + ([tok.token_id("<|im_end|>")] if stop else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd, port: int, timeout_s: float, poll_s: float):
    """``cmd`` (a server command line listening on ``port``) started with the repository on PYTHONPATH, and
    waited for until /health answers 200 (it must not exit first, nor take more than ``timeout_s``). Returns
    (the process, its stdout and stderr merged into one text pipe; its base URL)."""
    import httpx
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + timeout_s
        while True:
            assert p.poll() is None, p.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < t_end, "server did not come up"
            time.sleep(poll_s)
    except BaseException:
        stop_process(p)
        raise
    return p, url


def stop_process(p) -> None:
    """Kill ``p`` if it still runs (a test's clean-up after a failure)."""
    if p.poll() is None:
        p.kill()
        p.wait(10)


def run_threads(fns, timeout_s: float) -> None:
    """Each of ``fns`` in its own thread, all started before any is joined (at most ``timeout_s`` each)."""
    import threading
    th = [threading.Thread(target=f) for f in fns]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout_s)


def wait_drained(loop, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the loop runs nothing and its KV pool is whole again; the caller
    asserts what it expects."""
    pool = loop.sched.pool
    t_end = time.monotonic() + timeout_s
    while (pool.free_pages != pool.num_pages or loop.running) and time.monotonic() < t_end:
        time.sleep(0.05)


__all__ = ["MODEL", "LocalServer", "demo_state", "scripted_state", "script_ids", "ScriptedExecutor", "free_port",
           "start_server", "stop_process", "run_threads", "wait_drained"]
