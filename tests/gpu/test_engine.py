"""GpuEngine end to end on the tiny Kimi-format checkpoints, against the numpy reference decode loop.

* glue kernels (cuda_src/engine_glue.cu) equal their numpy twins on random inputs (outputs poisoned);
* greedy tokens of ar / chain / ddtree (graph replay), 3 streams with prompts of 5, 40 and 270 tokens (two
  prefill chunks), 104 new tokens each, are judged TEACHER-FORCED (tests/_teacher_forced.py): one float32
  reference forward over prompt + the GPU's own output gives the reference logits at every emitted token;
  each token must be the reference argmax up to bf16 noise (gap < 0.05 logit std) or, only where the
  reference has a MoE routing near-tie at that position, up to a routing flip (gap < 1 std); the counts
  (tokens identical to the argmax before the first that is not, non-argmax tokens, max gap, flips) are
  printed. So every token of every stream is checked, not just those before the first near-tie;
* an oracle drafter (draft logits favouring the reference continuation) drives acceptance lengths of
  several tokens, so the KV compaction and the drafter appends of long accepted paths are exercised;
* ddtree greedy equals ar greedy on the GPU: equal token for token up to the first difference, which must be
  a tie in the reference on the common prefix; graph replay equals eager exactly; sampling with a fixed seed
  reproduces, another seed differs;
* continuous batching: 6 requests through 4 slots (joins/leaves mid-run) give the reference's tokens;
* a prompt that can never fit the KV pool is refused with the pool's message while the others finish;
* the KV pool returns to empty and the CuPy memory pool does not grow over hundreds of steps.
GPU memory: a few hundred MB. Time: dominated by the reference (~20 s of numpy on one core).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _oracle_draft  # noqa: E402
import _teacher_forced as tf  # noqa: E402

pytestmark = pytest.mark.gpu

N_NEW = 104
PROMPT_LENS = (5, 40, 270)


# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import DrafterConfig, TargetConfig
    from ddtree_cupy.reference.loop import DecodeLoop, Request
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, ddir = ensure_tiny_checkpoints()
    cfg, dcfg = TargetConfig.load(tdir), DrafterConfig.load(ddir)
    ref = ReferenceTarget(cfg, load_reference_weights(tdir, np.float32, cfg=cfg), np.float32)
    rng = np.random.default_rng(2024)
    prompts = [rng.integers(0, cfg.vocab_size - 256, n).tolist() for n in PROMPT_LENS]
    # every mode of the reference loop emits the same greedy tokens (tests/test_loop.py): 'ar' is the cheapest
    res = DecodeLoop(ref, None, "ar", 1).run([Request(p, N_NEW) for p in prompts])
    return dict(tdir=tdir, ddir=ddir, cfg=cfg, dcfg=dcfg, ref=ref, prompts=prompts,
                want=[s.output_ids for s in res.streams])


@pytest.fixture(scope="module")
def engine(tiny):
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    # 1024 cache tokens per stream (the attention is planned for that), 64 pages for all streams together
    return GpuEngine(tiny["cfg"], tiny["tdir"], tiny["dcfg"], tiny["ddir"], max_streams=4, max_budget=16,
                     kv_tokens=64 * 64, max_context=1024)


def requests(prompts, n_new=N_NEW, **kw):
    from ddtree_cupy.reference.loop import Request
    ns = n_new if isinstance(n_new, (list, tuple)) else [n_new] * len(prompts)
    return [Request(p, n, sample_stream=i, **kw) for i, (p, n) in enumerate(zip(prompts, ns))]


def check_all(tiny, res, what, n_new=None):
    """Every token of every stream, teacher-forced against the reference (asserts; returns the verdicts)."""
    prompts = tiny["prompts"] * 2
    verdicts = [tf.check_stream(tiny["ref"], p, s.output_ids, f"{what} stream {i}")
                for i, (p, s) in enumerate(zip(prompts, res.streams))]
    if n_new is not None:
        assert [len(s.output_ids) for s in res.streams] == list(n_new), what
    print(f"{what}: identical-to-argmax prefix {[v['identical'] for v in verdicts]}, non-argmax "
          f"{[v['non_argmax'] for v in verdicts]}, max gap {max(v['max_gap'] for v in verdicts):.3g} std, "
          f"routing flips {sum(v['flips'] for v in verdicts)}")
    return verdicts


def check_pool_empty(eng):
    pool = eng.last_pool
    assert pool.free_pages == pool.num_pages and not pool.active_slots
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------------
def test_glue_kernels_match_numpy():
    import cupy as cp
    from ddtree_cupy.kernels import engine_glue as g
    rng = np.random.default_rng(5)
    S, R, A, F, H = 5, 9, 8, 3, 40
    ctrl = np.zeros((5, S), np.int32)
    ctrl[g.CTRL_PREFIX] = rng.integers(0, 500, S)
    ctrl[g.CTRL_BONUS] = rng.integers(0, 1000, S)
    ctrl[g.CTRL_ACTIVE] = [1, 0, 1, 1, 0]
    ctrl[g.CTRL_BUDGET] = 8
    ctrl[g.CTRL_STEP] = rng.integers(1, 50, S)
    dc = cp.asarray(ctrl)
    i32 = lambda *s: cp.full(s, -7, cp.int32)  # noqa: E731  poisoned
    # root_tree
    outs = [i32(S, 129) for _ in range(4)] + [i32(S), cp.full((S, 129, 5), 0xDEADBEEF, cp.uint32)]
    g.root_tree(dc, *outs)
    host = [o.get() for o in outs]
    want = [h.copy() for h in host]
    g.root_tree_ref(ctrl, *want)
    for h, w in zip(host, want):
        assert (h == w).all()
    # tree_to_batch
    trt = rng.integers(0, 1000, (S, 129)).astype(np.int32)
    trp = rng.integers(0, 600, (S, 129)).astype(np.int32)
    trn = rng.integers(1, R + 3, S).astype(np.int32)
    trm = rng.integers(0, 2 ** 32, (S, 129, 5), dtype=np.uint64).astype(np.uint32)
    T = S * R
    ob = dict(tokens=i32(T), positions=i32(T), kv_pos=i32(T), stream_ids=i32(T), prefix_len=i32(S), n_rows=i32(S),
              row_start=i32(S), mask=cp.full((S, R, 5), 0xDEADBEEF, cp.uint32))
    g.tree_to_batch(dc, R, cp.asarray(trt), cp.asarray(trp), cp.asarray(trn), cp.asarray(trm), **ob)
    want = g.tree_to_batch_ref(ctrl, R, trt, trp, trn, trm)
    for k, v in ob.items():
        assert (v.get() == want[k]).all(), k
    # post_scatter
    ids = rng.integers(0, 1000, T).astype(np.int32)
    post = i32(S, 129)
    g.post_scatter(cp.asarray(ids), R, post)
    assert (post.get() == g.post_scatter_ref(ids, S, R)).all()
    # vocab_rows: gathered shards [tp, T, Vl] -> whole rows [T, tp*Vl] (sampling under TP)
    parts = rng.standard_normal((4, T, 37)).astype(np.float32)
    rows = cp.full((T, 4 * 37), np.nan, cp.float32)
    g.vocab_rows(cp.asarray(parts), rows)
    assert (rows.get() == g.vocab_rows_ref(parts)).all()
    assert (g.vocab_rows_ref(parts)[3, 2 * 37:3 * 37] == parts[2, 3]).all()
    # after_walk (with and without features)
    n_acc = rng.integers(1, A + 1, S).astype(np.int32)
    otok = rng.integers(0, 1000, (S, A + 1)).astype(np.int32)
    frows = rng.integers(0, T, (S, A)).astype(np.int32)
    feats = rng.integers(0, 2 ** 16, (T, F, H)).astype(np.uint16)
    for with_feats in (True, False):
        app = cp.full((S * A, F, H), 0xFFFF, cp.uint16)
        sid, pos, packed = i32(S * A), i32(S * A), i32(S, A + 3)
        g.after_walk(dc, cp.asarray(n_acc), cp.asarray(trn), cp.asarray(otok), cp.asarray(frows),
                     cp.asarray(feats) if with_feats else None, app if with_feats else None,
                     sid if with_feats else None, pos if with_feats else None, packed)
        want = g.after_walk_ref(ctrl, n_acc, trn, otok, frows, feats if with_feats else None)
        assert (packed.get() == want["packed"]).all()
        if with_feats:
            assert (sid.get() == want["app_sid"]).all() and (pos.get() == want["app_pos"]).all()
            use = want["use"]
            assert (app.get()[use] == want["app_feats"][use]).all()
            assert (app.get()[~use] == 0xFFFF).all()      # unused rows untouched
    # sample_params
    st, sk = rng.random(S).astype(np.float32), rng.integers(0, 50, S).astype(np.int32)
    sp, ss = rng.random(S).astype(np.float32), rng.integers(0, 2 ** 63, S, dtype=np.uint64)
    o = dict(temp=cp.full(T, np.nan, cp.float32), topk=i32(T), topp=cp.full(T, np.nan, cp.float32),
             seeds=cp.zeros(T, cp.uint64), steps=cp.full(T, -1, cp.int64))
    g.sample_params(dc, R, cp.asarray(st), cp.asarray(sk), cp.asarray(sp), cp.asarray(ss), **o)
    want = g.sample_params_ref(ctrl, R, st, sk, sp, ss)
    for k, v in o.items():
        assert (v.get() == want[k]).all(), k


@pytest.mark.parametrize("mode,budget,cap_k,chain", [("ar", 1, None, False), ("chain", 8, None, False),
                                                     ("ddtree", 16, None, False), ("ddtree", 12, 2, True)])
def test_greedy_equals_reference(tiny, engine, mode, budget, cap_k, chain):
    engine.eager = False
    res = engine.generate(requests(tiny["prompts"]), mode, budget, cap_k, chain)
    check_all(tiny, res, f"{mode} b{budget}", n_new=[N_NEW] * 3)
    assert [s.finish_reason for s in res.streams] == ["length"] * 3
    for s in res.streams:            # accepted lengths account for every emitted token
        assert 1 + sum(s.accept_lens) >= len(s.output_ids) and s.tree_sizes
        assert all(1 <= a <= (1 if mode == "ar" else engine.models.depth + 1) for a in s.accept_lens)
    check_pool_empty(engine)
    _results[(mode, budget, cap_k, chain)] = [s.output_ids for s in res.streams]


_results: dict = {}


def test_ddtree_equals_ar_on_gpu(tiny, engine):
    engine.eager = False
    ar = _results.get(("ar", 1, None, False)) or [s.output_ids for s in engine.generate(
        requests(tiny["prompts"]), "ar", 1).streams]
    dd = engine.generate(requests(tiny["prompts"]), "ddtree", 16)
    check_all(tiny, dd, "ddtree b16", n_new=[N_NEW] * 3)
    same = [tf.check_lossless(tiny["ref"], p, s.output_ids, a, f"ddtree vs GPU ar stream {i}")
            for i, (p, s, a) in enumerate(zip(tiny["prompts"], dd.streams, ar))]
    print(f"ddtree vs GPU ar: equal tokens before the first difference {same} of {N_NEW}")


def oracle_draft(seqs):
    """Stands in for GpuDrafter.draft in eager mode: noise logits with the reference continuation's token
    boosted at every depth, so the tree contains the target's greedy path (acceptance up to D + 1). At every
    third position a wrong token is the top-1 and the right one rank 1: accepted paths leave the chain and
    the KV compaction moves rows."""
    return _oracle_draft.OracleDraft(seqs, off_chain_every=3)


def on_path_accepts(res, want):
    """Accepted lengths of the steps taken while each stream's output still equals the continuation the
    oracle boosts (after the first bf16 near-tie the GPU's path leaves the reference's and the oracle's
    proposals are wrong by construction, so only these steps say anything about the tree)."""
    acc = []
    for s, w in zip(res.streams, want):
        same = next((i for i, (a, b) in enumerate(zip(s.output_ids, w)) if a != b), len(w))
        done = 1                                   # token 0 is the prefill's
        for a in s.accept_lens:
            if done + a > same:
                break
            acc.append(a)
            done += a
    return acc


def test_oracle_drafter_long_acceptance(tiny, engine):
    seqs = {i: list(p) + list(w) for i, (p, w) in enumerate(zip(tiny["prompts"], tiny["want"]))}
    engine.eager = True
    engine.drafter.draft = oracle_draft(seqs)
    try:
        for mode, budget in (("ddtree", 16), ("chain", 8)):
            res = engine.generate(requests(tiny["prompts"]), mode, budget)
            check_all(tiny, res, f"oracle {mode}", n_new=[N_NEW] * 3)
            # while a stream's output equals the continuation the oracle boosts, the tree holds the target's
            # path: those steps must accept long paths (the compaction moves rows)
            acc = on_path_accepts(res, tiny["want"])
            print(f"oracle {mode}: mean acceptance {res.mean_accept_len:.2f}; {np.mean(acc):.2f} over the {len(acc)} "
                  f"steps on the oracle's path")
            if mode == "ddtree":
                assert len(acc) >= 5 and np.mean(acc) > 3.0, acc
            check_pool_empty(engine)
    finally:
        del engine.drafter.draft
        engine.eager = False


def test_graph_replay_equals_eager(tiny, engine):
    for mode, budget in (("ddtree", 8), ("ar", 1)):
        out = {}
        for eager in (False, True):
            engine.eager = eager
            res = engine.generate(requests(tiny["prompts"], n_new=40), mode, budget)
            out[eager] = ([s.output_ids for s in res.streams], res.accept_lens, res.tree_sizes)
        engine.eager = False
        assert out[False] == out[True], mode
    engine.eager, engine.profile = True, True
    try:
        res = engine.generate(requests(tiny["prompts"][:2], n_new=12), "ddtree", 8)
        for ph in ("draft", "tree", "verify", "accept"):
            assert res.phase_s.get(ph, 0) > 0, (ph, res.phase_s)
    finally:
        engine.eager, engine.profile = False, False


def test_sampling_reproducible(tiny, engine):
    kw = dict(temperature=0.9, top_p=0.95)
    ps = tiny["prompts"][:2]
    a = engine.generate(requests(ps, n_new=48, seed=7, **kw), "ddtree", 8)
    b = engine.generate(requests(ps, n_new=48, seed=7, **kw), "ddtree", 8)
    c = engine.generate(requests(ps, n_new=48, seed=8, **kw), "ddtree", 8)
    ta, tb, tc = ([s.output_ids for s in r.streams] for r in (a, b, c))
    assert ta == tb
    assert ta != tc
    V = tiny["cfg"].vocab_size
    assert all(0 <= t < V for s in ta for t in s) and all(len(s) == 48 for s in ta)
    check_pool_empty(engine)


def test_streams_join_and_leave(tiny, engine):
    """6 requests through 4 slots with different lengths: the waiting ones join as others finish; every
    stream's tokens are the reference's (a prefix of its 104-token continuation)."""
    ns = [N_NEW, 30, 60, 20, N_NEW, 45]
    ps = tiny["prompts"] * 2
    res = engine.generate(requests(ps, n_new=ns), "ddtree", 16)
    check_all(tiny, res, "join/leave", n_new=ns)
    check_pool_empty(engine)


def test_too_long_request_refused_others_continue(tiny, engine):
    rng = np.random.default_rng(9)
    long_prompt = rng.integers(0, 700, 3000).tolist()     # more than max_context = 1024 tokens per stream
    from ddtree_cupy.reference.loop import Request
    reqs = [Request(tiny["prompts"][0], 30), Request(long_prompt, 2000), Request(tiny["prompts"][1], 30)]
    res = engine.generate(reqs, "ddtree", 16)
    bad = res.streams[1]
    assert bad.finish_reason == "error" and "more than one stream may hold" in bad.error and not bad.output_ids
    for i, w in ((0, 0), (2, 1)):
        tf.check_stream(tiny["ref"], tiny["prompts"][w], res.streams[i].output_ids, f"refusal {i}")
        assert len(res.streams[i].output_ids) == 30
    check_pool_empty(engine)


def test_memory_does_not_grow(tiny, engine):
    """The same runs twice (deterministic: the same stream buckets, so every step shape exists after the
    first): the CuPy pool's bytes in use are the same after hundreds of steps."""
    import cupy as cp
    mp = cp.get_default_memory_pool()

    def runs():
        a = engine.generate(requests(tiny["prompts"][:2], n_new=400), "ar", 1)
        b = engine.generate(requests(tiny["prompts"][:2], n_new=200), "ddtree", 8)
        cp.cuda.Device().synchronize()
        return a.steps + b.steps
    steps = runs()
    before = mp.used_bytes()
    assert runs() == steps and steps >= 399 + 25
    assert mp.used_bytes() == before, (before, mp.used_bytes())
    check_pool_empty(engine)


@pytest.mark.parametrize("eager", [False, True])
def test_budget_auto_on_gpu(tiny, engine, eager):
    """--budget auto: split steps (draft + top-K graph, host budgets, build + verify + accept graph) and
    root-only steps; every token teacher-forced against the reference, the pool empty afterwards. With the
    random-weight tiny drafter the policy should mostly fall back (root-only, no draft); with the oracle
    drafter (eager) it should choose trees and accept long paths."""
    from ddtree_cupy.budget import BudgetPolicy
    engine.eager = eager
    try:
        res = engine.generate(requests(tiny["prompts"]), "ddtree", BudgetPolicy(16))
        check_all(tiny, res, f"auto eager={eager}", n_new=[N_NEW] * 3)
        check_pool_empty(engine)
        st = res.budget_stats
        assert len(st["steps"]) == res.steps
        print(f"auto eager={eager}: root-only steps {sum(not s['draft'] for s in st['steps'])} of {res.steps}, "
              f"mean budget {np.mean([b for s in st['steps'] for b in s['budgets'].values()]):.2f}")
        if eager:
            seqs = {i: list(p) + list(w) for i, (p, w) in enumerate(zip(tiny["prompts"], tiny["want"]))}
            engine.drafter.draft = oracle_draft(seqs)
            try:
                res = engine.generate(requests(tiny["prompts"]), "ddtree", BudgetPolicy(16))
            finally:
                del engine.drafter.draft
            check_all(tiny, res, "auto oracle", n_new=[N_NEW] * 3)
            acc = on_path_accepts(res, tiny["want"])
            print(f"auto oracle: mean acceptance {res.mean_accept_len:.2f}; {np.mean(acc):.2f} over the {len(acc)} "
                  f"steps on the oracle's path; tree sizes {res.tree_sizes[:16]}")
            # on the oracle's path the policy drafts trees and accepts beyond the root
            assert max(res.tree_sizes) > 1 and len(acc) >= 3 and np.mean(acc) > 1.5, acc
            check_pool_empty(engine)
    finally:
        engine.eager = False
