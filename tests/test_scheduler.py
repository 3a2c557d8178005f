"""The GPU engine's host side without a GPU: admission, continuous batching, slot reuse, stop conditions,
the KV pool back to empty, and the whole host loop (``engine.loop.EngineLoop``) driven by the numpy executor that
does exactly what the GPU step does per slot (reference target + drafter, packed outputs). With that
executor the engine's host loop must reproduce ``reference.loop.DecodeLoop`` token for token in every
mode, whatever the number of stream slots (streams joining and leaving never change a stream's tokens)."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_cupy.engine.kv_pool import KVPool
from ddtree_cupy.api import CTRL_ACTIVE, CTRL_BONUS, CTRL_BUDGET, CTRL_PREFIX, CTRL_STEP
from ddtree_cupy.backend import NumpyExecutor as _ProductExecutor
from ddtree_cupy.engine.loop import EngineLoop
from ddtree_cupy.engine.scheduler import (EngineStream, Scheduler, bucket_for, emit_tokens, make_buckets,
                                          pack_control)
from ddtree_cupy.reference.loop import DecodeLoop, Request, StreamState

from _specs import SMALL_256 as SMALL
from test_loop import _models, prompts


def make_pool(num_pages=64, max_streams=4, max_pages=8, tree_rows=9):
    return KVPool(num_pages, 64, max_streams, max_pages, tree_rows)


# ---------------- pure bookkeeping ------------------------------------------------------------------
def test_emit_rule_stop_kept_or_length():
    """The one stop rule (reference.loop.emit_tokens, used by both engines) against its definition:
    the stream's output is the longest prefix of everything offered that ends at the first stop id
    (kept) or at max_new_tokens, whichever comes first."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        req = Request([1], max_new_tokens=int(rng.integers(1, 12)),
                      stop_ids=tuple(int(x) for x in rng.integers(0, 20, rng.integers(0, 3))))
        st = StreamState(0, req, None, None, 1, 0)
        offered = []
        while not st.done:
            toks = rng.integers(0, 20, rng.integers(1, 6)).tolist()
            before = len(st.output_ids)
            em = emit_tokens(st, toks)
            assert st.output_ids[before:] == em == toks[:len(em)]
            offered += toks
        stop_at = next((i for i, t in enumerate(offered) if t in req.stop_ids), None)
        n = req.max_new_tokens if stop_at is None else min(stop_at + 1, req.max_new_tokens)
        assert st.output_ids == offered[:n]
        assert st.finish_reason == ("stop" if stop_at is not None and stop_at + 1 <= req.max_new_tokens else "length")


def test_buckets():
    assert make_buckets(10) == (1, 2, 4, 8, 10)
    assert make_buckets(3) == (1, 2, 3)
    assert make_buckets(1) == (1,)
    assert bucket_for(0, (1, 2, 4)) == 1 and bucket_for(2, (1, 2, 4)) == 4 and bucket_for(1, (1, 2, 4)) == 2
    with pytest.raises(ValueError, match="no stream bucket"):
        bucket_for(4, (1, 2, 4))
    with pytest.raises(ValueError, match="max_streams"):
        make_buckets(0)


def test_admission_waits_refuses_and_reuses_slots():
    pool = make_pool(num_pages=6, max_streams=2, max_pages=4)
    sch = Scheduler(pool, vocab_size=100, max_positions=10_000, depth=8)
    reqs = [Request([1] * 50, 20),          # 2 pages
            Request([1] * 300, 10),         # 6 pages > 4 per stream: never fits -> error, others go on
            Request([1] * 100, 20),         # 3 pages
            Request([1] * 10, 5)]           # 1 page: waits for a slot (both busy)
    sts = sch.submit(reqs)
    got = sch.admit()
    assert [s.index for s in got] == [0, 2] and [s.slot for s in got] == [0, 1]
    assert sts[1].finish_reason == "error" and "more than one stream may hold" in sts[1].error
    assert list(sch.waiting) == [sts[3]] and pool.free_pages == 1
    assert sch.admit() == []                # still no slot
    # stream 0 finishes on its first token (max_new 20 not reached -> use a stop id instead)
    sts[0].request.stop_ids = (7,)
    assert sch.after_prefill(sts[0], 7) == [7] and sts[0].finish_reason == "stop"
    assert 0 not in sch.by_slot and sch.table_dirty
    got = sch.admit()
    assert got == [sts[3]] and sts[3].slot == 0    # the freed slot is reused
    pool.check_invariants()


def test_request_larger_than_the_whole_pool_is_refused_with_reason():
    pool = make_pool(num_pages=3, max_streams=2, max_pages=8)
    sch = Scheduler(pool, 100, 10_000, depth=8)
    a, b = sch.submit([Request([1] * 300, 10), Request([2] * 5, 3)])
    assert sch.admit() == [b]
    assert a.finish_reason == "error" and "can never be admitted" in a.error and "KV pool full" in a.error


def test_invalid_request_raises_before_anything_runs():
    sch = Scheduler(make_pool(), 100, 1000, depth=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sch.submit([Request([1, 2]), Request([1, 500])])
    assert sch.streams == [] and not sch.busy


def test_step_bookkeeping_stop_length_context_and_pool_empty():
    pool = make_pool(num_pages=32, max_streams=3, max_pages=8)
    sch = Scheduler(pool, 100, max_positions=37, depth=3)
    a, b, c = sch.submit([Request([1] * 5, 6), Request([1] * 8, 50, stop_ids=(9,)), Request([1] * 30, 50)])
    assert sch.admit() == [a, b, c]
    for st, bonus in ((a, 11), (b, 12), (c, 13)):
        assert sch.after_prefill(st, bonus) == [bonus]
    ctrl = pack_control(sch.running(), 4, budget=7)
    assert ctrl.shape[1] == 4 and list(ctrl[CTRL_ACTIVE]) == [1, 1, 1, 0]
    assert list(ctrl[CTRL_PREFIX]) == [5, 8, 30, 0] and list(ctrl[CTRL_BONUS]) == [11, 12, 13, 0]
    assert list(ctrl[CTRL_BUDGET]) == [7, 7, 7, 0] and list(ctrl[CTRL_STEP]) == [1, 1, 1, 0]
    sch.begin_step()
    assert sch.after_step(a, 3, [11, 20, 21, 22, -1], 6) == [20, 21, 22]
    assert a.committed == 8 and a.bonus == 22 and a.output_ids == [11, 20, 21, 22]
    with pytest.raises(AssertionError, match="not the pending bonus"):
        sch.after_step(b, 1, [99, 5, -1], 4)
    assert sch.after_step(b, 2, [12, 9, 30, -1], 4) == [9] and b.finish_reason == "stop"
    assert b.committed == 10                  # accepted beyond the cut stay committed
    assert sch.after_step(c, 4, [13, 1, 2, 3, 4], 8) == [1, 2, 3, 4]
    assert c.committed == 34
    assert sch.end_context() == [c] and c.finish_reason == "context"     # 34 + 3 >= 37
    sch.begin_step()
    assert sch.after_step(a, 4, [22, 1, 2, 3, 4], 8) == [1, 2]          # length 6 reached
    assert a.finish_reason == "length" and a.output_ids == [11, 20, 21, 22, 1, 2]
    assert not sch.busy and pool.free_pages == pool.num_pages and (pool.block_table == -1).all()
    assert sch.accept_lens == [3, 2, 4, 4] and sch.tree_sizes == [6, 4, 8, 8] and sch.steps == 2
    with pytest.raises(ValueError, match="accepted length"):
        sch.after_step(a, 0, [22, -1], 1)
    pool.check_invariants()


# ---------------- the host loop over a numpy executor ----------------------------------------------
def run_generation(executor, sched, requests, buckets, on_tokens=None):
    """The batch client of the online loop, over ``executor``."""
    return EngineLoop(executor, sched, buckets).generate(requests, on_tokens)


class NumpyExecutor(_ProductExecutor):
    """The numpy backend's executor (what the GPU step computes, per slot, in numpy: the same packed output
    rows), counting block-table uploads and the largest bucket it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tables = 0
        self.max_bucket_seen = 0

    def write_block_table(self, table):
        self.tables += 1

    def step(self, running, bucket, budgets):
        self.max_bucket_seen = max(self.max_bucket_seen, bucket)
        return super().step(running, bucket, budgets)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(str(tmp_path_factory.mktemp("tiny_sched")), 3, "float32")


@pytest.mark.parametrize("mode,budget,max_streams", [("ar", 1, 4), ("ddtree", 8, 4), ("ddtree", 8, 2),
                                                      ("chain", 8, 1), ("ddtree", 5, 3)])
def test_host_loop_equals_reference_loop(models, mode, budget, max_streams):
    tgt, dr = models
    ps = prompts(4, 11)
    # different lengths and a stop id so streams leave at different rounds and waiting ones join
    reqs = lambda: [Request(p, max_new_tokens=20 + 9 * i, sample_stream=i, stop_ids=(5,) if i == 1 else ())  # noqa
                    for i, p in enumerate(ps)]
    ref = DecodeLoop(tgt, dr if mode != "ar" else None, mode, budget).run(reqs())
    depth = 0 if mode == "ar" else dr.block_size - 1
    pool = KVPool(64, 64, max_streams, 8, (budget if mode == "ddtree" else depth) + 1)
    sch = Scheduler(pool, SMALL.vocab_size, tgt.cfg.max_position_embeddings, depth)
    ex = NumpyExecutor(tgt, dr, mode, budget, max_streams=max_streams)
    seen = {}
    res = run_generation(ex, sch, reqs(), make_buckets(max_streams),
                         on_tokens=lambda st, em: seen.setdefault(st.index, []).extend(em))
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    assert [s.finish_reason for s in res.streams] == [s.finish_reason for s in ref.streams]
    assert seen == {i: s.output_ids for i, s in enumerate(ref.streams)}
    assert sorted(res.accept_lens) == sorted(ref.accept_lens)
    assert [s.accept_lens for s in res.streams] == [s.accept_lens for s in ref.streams]
    if max_streams >= 4:
        assert res.steps == ref.steps and res.accept_lens == ref.accept_lens
    assert ex.max_bucket_seen <= max_streams
    assert pool.free_pages == pool.num_pages and not sch.by_slot
    pool.check_invariants()


def test_host_loop_sampling_matches_reference(models):
    tgt, dr = models
    ps = prompts(3, 5)
    reqs = lambda: [Request(p, max_new_tokens=25, temperature=0.8, top_p=0.9, seed=42, sample_stream=i)  # noqa
                    for i, p in enumerate(ps)]
    ref = DecodeLoop(tgt, dr, "ddtree", 6).run(reqs())
    pool = KVPool(64, 64, 2, 8, 7)
    res = run_generation(NumpyExecutor(tgt, dr, "ddtree", 6, max_streams=2),
                         Scheduler(pool, SMALL.vocab_size, tgt.cfg.max_position_embeddings, dr.block_size - 1),
                         reqs(), make_buckets(2))
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]


def test_host_loop_refuses_too_long_prompt_and_others_finish(models):
    tgt, dr = models
    ps = prompts(3, 2)
    ps[1] = list(range(100)) * 2                         # 200 tokens: more than one stream may hold
    reqs = [Request(p, max_new_tokens=12) for p in ps]
    pool = KVPool(16, 64, 2, 3, 9)                       # 3 pages = 192 tokens per stream
    res = run_generation(NumpyExecutor(tgt, dr, "ddtree", 8, max_streams=2),
                         Scheduler(pool, SMALL.vocab_size, tgt.cfg.max_position_embeddings, dr.block_size - 1),
                         reqs, make_buckets(2))
    ref = DecodeLoop(tgt, dr, "ddtree", 8).run([reqs[0], reqs[2]])
    assert res.streams[1].finish_reason == "error" and "KVPoolFull" not in res.streams[1].error
    assert "more than one stream may hold" in res.streams[1].error and res.streams[1].output_ids == []
    assert [res.streams[0].output_ids, res.streams[2].output_ids] == [s.output_ids for s in ref.streams]
    assert pool.free_pages == pool.num_pages


@pytest.mark.parametrize("mode", ["ddtree", "ar"])
def test_host_loop_context_limit_with_pool_sized_to_positions(models, mode):
    """max_new_tokens beyond the position limit: the reservation is capped at the limit (the pool holds
    max_position_embeddings + tree rows per stream) and the streams end with 'context' like the reference."""
    tgt, dr = models
    maxpos = tgt.cfg.max_position_embeddings
    reqs = lambda: [Request(p, max_new_tokens=10 * maxpos) for p in prompts(2, 4)]   # noqa: E731
    ref = DecodeLoop(tgt, dr if mode != "ar" else None, mode, 8).run(reqs())
    depth = 0 if mode == "ar" else dr.block_size - 1
    rows = 9 if mode == "ddtree" else 1
    pool = KVPool(40, 64, 2, -(-(maxpos + rows) // 64), rows)
    res = run_generation(NumpyExecutor(tgt, dr, mode, 8, max_streams=2),
                         Scheduler(pool, SMALL.vocab_size, maxpos, depth), reqs(), make_buckets(2))
    assert [s.finish_reason for s in res.streams] == [s.finish_reason for s in ref.streams] == ["context"] * 2
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    assert pool.free_pages == pool.num_pages
