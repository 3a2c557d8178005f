"""Dry run of the GPU engine's own code (engine/step.py, engine/gpu_engine.py, the kernel wrappers it calls)
on the CPU: CuPy is replaced by the numpy stand-in of tests/_fake_cupy.py, every kernel the step launches (DDTree
top-K / builder / walk, KV compaction, the engine glue) by the numpy implementation of tests/_kernel_emul.py that
reads its raw launch arguments in the order of the .cu signature, and the target / drafter by toy models with the
same interfaces (tests/_engine_toys.py). CUDA-graph
capture is emulated: launches during capture are recorded and replayed later against the same buffers
(so a step whose host code depends on values, or passes a buffer that the replay does not see, fails).

The toy target's next-token choice depends on every token it can see (the paged cache through the block
table plus the tree rows its ancestor mask allows), and the toy drafter proposes the true continuation
with deliberate mistakes, so trees branch, walks accept several nodes and the KV compaction matters.
The engine (graphs and eager) must reproduce ``reference.loop.DecodeLoop`` over the same toy models token
for token, with continuous batching, refusals and the pool back to empty. This checks the plumbing
(arguments, layouts, slot/row bookkeeping); the kernels themselves are tested on the GPU.
"""
from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import _fake_cupy as fake
from _engine_toys import SPEC, fake_gpu, make, reqs  # noqa: F401  (fake_gpu: the fixture)
from _fake_cupy import run_or_record

from ddtree_cupy.reference.loop import DecodeLoop, Request


@pytest.mark.parametrize("mode,budget,cap_k,chain", [("ddtree", 12, None, False), ("ddtree", 6, 2, True),
                                                     ("chain", 7, None, False), ("ar", 1, None, False)])
@pytest.mark.parametrize("eager", [False, True])
def test_engine_equals_reference_loop(fake_gpu, mode, budget, cap_k, chain, eager):
    eng, rt, rd = make(eager=eager)
    ref = DecodeLoop(rt, rd if mode != "ar" else None, mode, budget, cap_k, chain).run(reqs())
    seen = {}
    res = eng.generate(reqs(), mode, budget, cap_k, chain, on_tokens=lambda st, em: seen.setdefault(st.index, []).extend(em))
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    assert [s.finish_reason for s in res.streams] == [s.finish_reason for s in ref.streams]
    assert [s.accept_lens for s in res.streams] == [s.accept_lens for s in ref.streams]
    assert [s.tree_sizes for s in res.streams] == [s.tree_sizes for s in ref.streams]
    assert seen == {i: s.output_ids for i, s in enumerate(ref.streams)}
    if mode in ("ddtree", "chain"):
        assert max(ref.accept_lens) >= 3          # long accepted paths: the compaction really moved rows
    assert "context" in [s.finish_reason for s in ref.streams]       # 70 + 200 > 160 positions
    pool = eng.last_pool
    assert pool.free_pages == pool.num_pages
    assert (eng.steps and all((st.graph is None) == eager for st in eng.steps.values()))
    # default pdl='auto': graphs of <= PDL_MAX_ROWS rows were captured with PDL, the global switch restored
    from ddtree_cupy.engine.step import PDL_MAX_ROWS
    from ddtree_cupy.kernels import launch
    assert all(st.pdl == (st.T <= PDL_MAX_ROWS) for st in eng.steps.values() if st.graph is not None)
    assert not launch.pdl_enabled()


def test_pdl_setting(fake_gpu):
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    from ddtree_cupy.engine.step import PDL_MAX_ROWS, use_pdl
    assert use_pdl("auto", PDL_MAX_ROWS) and not use_pdl("auto", PDL_MAX_ROWS + 1)
    assert use_pdl(True, 10 ** 6) and not use_pdl(False, 1)
    with pytest.raises(ValueError, match="pdl must be"):
        GpuEngine(SPEC.target_config(), None, SPEC.drafter_config(), None, random_weights=0, pdl="yes")


def test_continuous_batching_and_refusal(fake_gpu):
    eng, rt, rd = make(max_streams=2, kv_tokens=64 * 6)       # 6 pages: 3 per stream at most at once
    rs = reqs(lens=(3, 40, 150, 9, 20), n_new=(50, 30, 5, 12, 40))   # 150 + 5 + 13 rows > 2 pages? needs 3
    ref = DecodeLoop(rt, rd, "ddtree", 12).run(rs)
    res = eng.generate(reqs(lens=(3, 40, 150, 9, 20), n_new=(50, 30, 5, 12, 40)), "ddtree", 12)
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in ref.streams]
    assert eng.last_pool.free_pages == eng.last_pool.num_pages
    # a pool too small for one request: it is refused, the others run
    eng2, _, _ = make(max_streams=2, kv_tokens=64 * 2)
    res2 = eng2.generate(reqs(lens=(3, 150, 9), n_new=(20, 5, 12)), "ddtree", 12)
    assert res2.streams[1].finish_reason == "error" and "may hold" in res2.streams[1].error
    want = DecodeLoop(rt, rd, "ddtree", 12).run([reqs(lens=(3, 150, 9), n_new=(20, 5, 12))[i] for i in (0, 2)])
    assert [res2.streams[0].output_ids, res2.streams[2].output_ids] == [s.output_ids for s in want.streams]


def test_profile_mode_reports_phases(fake_gpu):
    eng, rt, rd = make(eager=True)
    eng.profile = True
    res = eng.generate(reqs()[:2], "ddtree", 8)
    assert {"draft", "tree", "verify", "accept", "prefill"} <= set(res.phase_s)


def test_memory_sized_pool_and_cli_through_cupy_backend(fake_gpu, monkeypatch, tmp_path, capsys):
    """kv_tokens=None sizes the pool from (fake) free memory, capped at every slot's longest context; the CLI
    with --backend cupy runs the engine end to end (toy models) and reports every stream."""
    import json

    from ddtree_cupy.models import drafter as md
    from ddtree_cupy.models import weights as mw
    from ddtree_cupy.run import main
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    eng, rt, rd = make(kv_tokens=None)
    assert eng.num_pages == eng.max_streams * eng.max_pages_per_stream
    res = eng.generate(reqs(), "ddtree", 8)
    assert [s.output_ids for s in res.streams] == [s.output_ids for s in DecodeLoop(rt, rd, "ddtree", 8).run(
        reqs()).streams]
    tdir, ddir = ensure_tiny_checkpoints(str(tmp_path), spec=SPEC)
    monkeypatch.setattr(mw.GpuTargetWeights, "from_checkpoint", staticmethod(lambda *a, **k: SimpleNamespace()))
    monkeypatch.setattr(md.GpuDrafterWeights, "from_checkpoint", staticmethod(lambda *a, **k: SimpleNamespace()))
    rc = main(["--model", tdir, "--drafter", ddir, "--prompt-ids", "5,6,7", "--prompt-ids", "9,10",
               "--max-new-tokens", "20", "--backend", "cupy", "--json", "--ignore-eos", "--budget", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    js = json.loads(out.out.strip().splitlines()[-1])
    want = DecodeLoop(rt, rd, "ddtree", 6).run([Request([5, 6, 7], 20), Request([9, 10], 20)])
    assert [s["output_ids"] for s in js["streams"]] == [s.output_ids for s in want.streams]


@pytest.mark.slow
def test_engine_with_real_target_on_cpu_emulation():
    """tests/_engine_target_emul.py in a subprocess: the engine around the REAL GpuTarget (every kernel emulated
    by tests/_kernel_emul.py), ar / ddtree / chain with an oracle drafter, graphs and eager, against the float64
    reference's greedy tokens (fails, for instance, when the KV compaction is skipped)."""
    import os
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "_engine_target_emul.py")], cwd=os.path.dirname(here),
                       capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and "ENGINE-EMUL OK" in r.stdout, tail


DRAWS: list = []


def fake_sample(logits, temperature, top_k, top_p, seeds, steps, out=None):
    """Stand-in for kernels.sample.sample: the reference sampler fed the GPU kernel's uniform
    (reference.ddtree.philox_uniform(seed, step)), which is what the kernel computes."""
    from ddtree_cupy.reference.ddtree import philox_uniform, sample_from_logits

    def op():
        for i in range(logits.shape[0]):
            t = float(temperature[i])
            if t <= 0:
                out[i] = int(np.argmax(logits[i]))
                continue
            key = (int(seeds[i]), int(steps[i]))
            DRAWS.append(key)
            u = float(philox_uniform(key[0], np.array([key[1]], np.uint64))[0])
            out[i] = sample_from_logits(logits[i], u, t, float(top_p[i]), int(top_k[i]))
    run_or_record(op)
    return out


def test_sampling_plumbing_reproducible(fake_gpu, monkeypatch):
    from ddtree_cupy.kernels import sample as ks
    monkeypatch.setattr(ks, "sample", fake_sample)
    eng, rt, rd = make()
    mk = lambda seed: [Request(r.prompt_ids, 30, temperature=0.9 if i != 1 else 0.0, seed=seed, sample_stream=i)  # noqa
                       for i, r in enumerate(reqs())]
    outs = []
    for seed in (5, 5, 6):
        DRAWS.clear()
        outs.append([s.output_ids for s in eng.generate(mk(seed), "ddtree", 8).streams])
        # every sampled row of every round draws with its own (seed, step) key
        assert len(DRAWS) == len(set(DRAWS)) > 0
    assert outs[0] == outs[1] and outs[0] != outs[2]
    # the greedy stream in the sampled batch: the reference's greedy tokens
    greedy = DecodeLoop(rt, rd, "ddtree", 8).run([Request(reqs()[1].prompt_ids, 30)])
    assert outs[0][1] == greedy.streams[0].output_ids
    assert any(k[1] == 0 for k in DRAWS)                  # prefill draws with round 0
    assert eng.last_pool.free_pages == eng.last_pool.num_pages
    # one Philox mapping: the reference loop replays the engine's sampled run token for token
    replay = DecodeLoop(rt, rd, "ddtree", 8).run(mk(5))
    assert [s.output_ids for s in replay.streams] == outs[0]


class ThreadComm:
    """Rank ``rank`` of a group of threads: all_gather rendezvous at replay time (recorded like a launch, so
    it also works inside an emulated graph), into a static [size, ...] buffer per call site."""

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared = rank, size, shared
        self._bufs = {}
        self.backend = "threads"

    def all_reduce(self, x):
        raise AssertionError("the toy models issue no all-reduce")

    def broadcast_obj(self, obj, root=0):
        """Host objects (the engine loop's per-step control) from ``root``, at call time (never recorded)."""
        sh = self.shared
        sh["barrier"].wait()
        if self.rank == root:
            sh["obj"] = obj
        sh["barrier"].wait()
        got = sh["obj"]
        sh["barrier"].wait()
        return got

    def all_gather(self, x):
        key = (x.shape, x.dtype.str, x.__array_interface__["data"][0])
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = fake.cp.zeros((self.size,) + x.shape, x.dtype)
        sh = self.shared

        def op():
            sh["barrier"].wait()
            sh["parts"][self.rank] = np.array(x)
            sh["barrier"].wait()
            for r in range(self.size):
                buf[r] = sh["parts"][r]
            sh["barrier"].wait()
        run_or_record(op)
        return buf


def two_ranks(work):
    """``work(engine)`` on each of two engines, ranks 0 and 1 of TP = 2 over ``ThreadComm`` (one thread each,
    the toy models, random weights); returns [rank 0's result, rank 1's], or raises the first rank's error."""
    shared = {"barrier": threading.Barrier(2, timeout=60), "parts": [None, None]}
    out, errors = [None, None], []

    def rank_main(r):
        try:
            from ddtree_cupy.engine.gpu_engine import GpuEngine
            tcfg, dcfg = SPEC.target_config(), SPEC.drafter_config()
            eng = GpuEngine(tcfg, None, dcfg, None, comm=ThreadComm(r, 2, shared), max_streams=4, max_budget=12,
                            kv_tokens=64 * 40, random_weights=0, prefill_chunk=32)
            out[r] = work(eng)
        except BaseException as e:    # noqa: BLE001 - reported below
            errors.append(e)
            shared["barrier"].abort()
    th = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("mode,budget", [("ddtree", 12), ("chain", 7), ("ar", 1)])
def test_tensor_parallel_two_ranks_equal_reference(fake_gpu, mode, budget):
    """Two engines (ranks 0 and 1 of TP = 2, one thread each) with vocabulary-split logits: the keys are
    all-gathered and merged (parts-major) for the draft top-K and the target argmax; both ranks emit the
    reference loop's tokens."""
    _, rt, rd = make()

    def run(eng):
        res = eng.generate(reqs(), mode, budget)
        return [s.output_ids for s in res.streams], res.accept_lens
    out = two_ranks(run)
    ref = DecodeLoop(rt, rd if mode != "ar" else None, mode, budget).run(reqs())
    assert out[0] == out[1]
    assert out[0][0] == [s.output_ids for s in ref.streams]
    assert out[0][1] == ref.accept_lens


def test_tensor_parallel_sampling_equals_one_rank(fake_gpu, monkeypatch):
    """Sampled decoding under TP = 2: each rank gathers whole vocabulary rows (all-gather + eg_vocab_rows)
    and samples them with the same keys, so both ranks emit exactly the tokens of a TP = 1 engine; a
    greedy stream in the same batch keeps the reference's greedy tokens."""
    from ddtree_cupy.kernels import sample as ks
    monkeypatch.setattr(ks, "sample", fake_sample)
    mk = lambda: [Request(r.prompt_ids, 30, temperature=0.9 if i != 1 else 0.0, seed=11, sample_stream=i)  # noqa
                  for i, r in enumerate(reqs())]
    eng1, _, _ = make()
    DRAWS.clear()
    one = [s.output_ids for s in eng1.generate(mk(), "ddtree", 8).streams]
    draws_one = sorted(DRAWS)
    DRAWS.clear()
    out = two_ranks(lambda eng: [s.output_ids for s in eng.generate(mk(), "ddtree", 8).streams])
    assert out[0] == out[1] == one
    assert sorted(set(DRAWS)) == sorted(set(draws_one)) and len(draws_one) > 0   # the same keys were drawn
