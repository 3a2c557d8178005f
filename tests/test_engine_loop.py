"""The online engine loop without HTTP: submissions from several threads at any time join the running
batch and get exactly their own tokens; cancellation of queued and running streams; immediate refusals
with their kind; the per-step budget hook; a failing executor ends every stream with an error instead of
leaving a client waiting."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ddtree_cupy.api import Refused, Request
from ddtree_cupy.engine.kv_pool import KVPool
from ddtree_cupy.engine.loop import EngineLoop
from ddtree_cupy.engine.scheduler import Scheduler, make_buckets

from _serve_helpers import ScriptedExecutor

V = 1000


class IdTok:
    """Enough of a tokenizer for ScriptedExecutor: the script is chosen by the prompt's first id."""

    def decode(self, ids):
        return f"script:s{ids[0] % 5}"


SCRIPTS = {f"s{k}": [int(x) for x in np.random.default_rng(k).integers(0, V, 300)] for k in range(5)}


def make_loop(max_streams=3, max_queue=None, num_pages=32, pages_per_stream=4, step_sleep=0.0, ex=None):
    ex = ex or ScriptedExecutor(IdTok(), SCRIPTS, step_sleep)
    pool = KVPool(num_pages, 64, max_streams, pages_per_stream, ex.dev_budget + 1)
    sched = Scheduler(pool, V, 4096, 8, keep_history=False, on_release=ex.release)
    return EngineLoop(ex, sched, make_buckets(max_streams), max_queue=max_queue), ex


def start(loop):
    th = threading.Thread(target=loop.run, daemon=True)
    th.start()
    return th


def test_submissions_from_threads_join_and_get_their_own_tokens():
    loop, ex = make_loop(max_streams=3)
    th = start(loop)
    got, handles = {}, {}
    rng = np.random.default_rng(0)
    plan = [(int(rng.integers(0, 50)), int(rng.integers(1, 60)), float(rng.uniform(0, 0.2))) for _ in range(12)]

    def client(k):
        first, n, delay = plan[k]
        time.sleep(delay)
        toks = []
        h = loop.submit(Request([first, 1, 2], n), sink=lambda h, t, fin: toks.extend(t))
        handles[k] = h
        assert h.finished.wait(30)
        got[k] = toks
    cs = [threading.Thread(target=client, args=(k,)) for k in range(12)]
    for c in cs:
        c.start()
    for c in cs:
        c.join(60)
    for k, (first, n, _) in enumerate(plan):
        assert got[k] == SCRIPTS[f"s{first % 5}"][:n] == handles[k].output_ids
        assert handles[k].finish_reason == "length"
    loop.stop()
    th.join(10)
    pool = loop.sched.pool
    assert pool.free_pages == pool.num_pages and sorted(ex.released) == sorted(h.stream.index for h in handles.values())


def test_cancel_queued_and_running():
    loop, ex = make_loop(max_streams=1, step_sleep=0.01)
    a = loop.submit(Request([0, 1], 200))
    b = loop.submit(Request([1, 1], 5))
    loop.cancel(b)                           # still queued: dropped, never prefilled
    th = start(loop)
    t_end = time.monotonic() + 10
    while len(a.output_ids) < 5 and time.monotonic() < t_end:
        time.sleep(0.005)
    loop.cancel(a)
    assert a.finished.wait(10) and b.finished.wait(10)
    assert b.finish_reason == "cancelled" and b.output_ids == [] and b.stream.index not in ex.ids
    assert a.finish_reason == "cancelled" and 5 <= len(a.output_ids) < 200
    assert a.output_ids == SCRIPTS["s0"][:len(a.output_ids)]
    pool = loop.sched.pool
    assert pool.free_pages == pool.num_pages
    c = loop.submit(Request([2, 1], 7))      # the loop goes on
    assert c.finished.wait(10) and c.output_ids == SCRIPTS["s2"][:7]
    loop.stop()
    th.join(10)


def test_refusals_are_immediate_with_their_kind():
    loop, _ = make_loop(max_streams=1, max_queue=1, pages_per_stream=2)
    with pytest.raises(Refused) as e:
        loop.submit(Request([1, V + 5], 3))
    assert e.value.kind == "invalid" and "outside the vocabulary" in str(e.value)
    with pytest.raises(Refused) as e:
        loop.submit(Request([1] * 100, 100))           # 2 pages of 64 per stream
    assert e.value.kind == "too_long" and "more than one stream may hold" in str(e.value)
    loop.submit(Request([1], 3))
    loop.submit(Request([2], 3))
    with pytest.raises(Refused) as e:
        loop.submit(Request([3], 3))
    assert e.value.kind == "queue_full"
    loop.stop()
    loop.run()
    with pytest.raises(Refused) as e:
        loop.submit(Request([3], 3))
    assert e.value.kind == "shutdown"


def test_budget_hook_reaches_the_executor():
    seen = []

    class Ex(ScriptedExecutor):
        def step(self, running, bucket, budgets):
            seen.append(list(budgets))
            return super().step(running, bucket, budgets)

    class Loop(EngineLoop):
        def decide_budgets(self, running):
            return [1 + st.index for st in running]

    ex = Ex(IdTok(), SCRIPTS)
    pool = KVPool(32, 64, 2, 4, ex.dev_budget + 1)
    loop = Loop(ex, Scheduler(pool, V, 4096, 8), make_buckets(2))
    res = loop.generate([Request([0], 6), Request([1], 9)])
    assert [s.output_ids for s in res.streams] == [SCRIPTS["s0"][:6], SCRIPTS["s1"][:9]]
    assert seen and all(b in ([1, 2], [2], [1]) for b in seen)


def test_executor_failure_ends_every_stream_and_refuses_new_ones():
    class Broken(ScriptedExecutor):
        def step(self, running, bucket, budgets):
            raise RuntimeError("device lost")
    loop, _ = make_loop(ex=Broken(IdTok(), SCRIPTS))
    fins = []
    h = loop.submit(Request([0], 50), sink=lambda h, t, fin: fins.append(fin))
    with pytest.raises(RuntimeError, match="device lost"):
        loop.run()
    assert h.finished.is_set() and h.finish_reason == "error" and "device lost" in h.stream.error
    assert fins[-1] == "error"
    with pytest.raises(Refused) as e:
        loop.submit(Request([0], 5))
    assert e.value.kind == "shutdown"


def test_engines_and_server_take_their_types_from_api():
    """One API module: the reference re-exports the same objects, and no product module outside the
    reference imports the loop's types from it."""
    import pathlib

    from ddtree_cupy import api
    from ddtree_cupy.reference import loop as ref_loop
    for name in ("Request", "StreamState", "GenerationResult", "StepRecord", "emit_tokens", "MODES", "MAX_BUDGET"):
        assert getattr(ref_loop, name) is getattr(api, name)
    pkg = pathlib.Path(api.__file__).parent
    for f in list((pkg / "engine").glob("*.py")) + list((pkg / "serve").glob("*.py")) + [pkg / "run.py"]:
        assert "reference.loop import" not in f.read_text(), f


def test_stop_ends_running_and_queued_streams_and_tells_their_clients():
    loop, _ = make_loop(max_streams=1, step_sleep=0.01)
    fins = {}
    a = loop.submit(Request([0], 200), sink=lambda h, t, fin: fin and fins.setdefault("a", fin))
    th = start(loop)
    t_end = time.monotonic() + 10
    while not a.output_ids and time.monotonic() < t_end:
        time.sleep(0.005)
    b = loop.submit(Request([1], 5), sink=lambda h, t, fin: fin and fins.setdefault("b", fin))
    loop.stop()
    th.join(10)
    assert not th.is_alive() and a.finished.is_set() and b.finished.is_set()
    assert fins == {"a": "cancelled", "b": "cancelled"}
    assert loop.sched.pool.free_pages == loop.sched.pool.num_pages
