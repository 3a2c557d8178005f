"""The GPU engine with the REAL GpuTarget on the CPU (run in a subprocess by tests/test_engine_cpu.py):
tests/_kernel_emul.py installs the numpy CuPy stand-in (tests/_fake_cupy.py) and emulates every kernel, the
target's (bf16 rounding where the kernels round) and the step's own (DDTree top-K / walk, KV compaction over the
stand-in's allocation table, so it moves the real target's latent rows, engine glue). Autoregressive greedy
decoding of the tiny checkpoint (no drafter: its kernels are not emulated)
through chunked prefill and the captured step (graphs and eager) must give the float64 reference's tokens,
a differing token only at a real near-tie. The same for 'ddtree' and 'chain' with an oracle drafter in the
GpuDrafter interface (draft logits boosting the reference continuation, so walks accept long paths and the
compaction moves real latent rows): speculative decoding must not change a token.
Prints 'ENGINE-EMUL OK' at the end."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import _kernel_emul  # noqa: E402

_kernel_emul.install()      # before anything imports cupy

import numpy as np  # noqa: E402

from _fake_cupy import run_or_record  # noqa: E402
from _oracle_draft import oracle_draft_logits  # noqa: E402


class OracleGpuDrafter:
    """GpuDrafter's interface; ``draft`` boosts the reference continuation of the stream in each slot (read
    at replay time, so it also works inside a recorded graph), with a wrong top-1 at every third position
    so accepted paths leave the chain and the compaction moves rows. The context append only counts."""
    seqs: dict = {}

    def __init__(self, dcfg, w, target, comm=None, max_streams=1, max_ctx=4096, max_append=64):
        self.cfg, self.N_max = dcfg, max_append
        self.V = target.cfg.vocab_size
        self.rng = np.random.default_rng(3)
        self.k_cache, self.v_cache = [], []
        self.appended = 0

    def append_context(self, feats, stream_ids, positions):
        assert feats.shape[0] <= self.N_max

        def op():
            self.appended += int((np.asarray(positions) >= 0).sum())
        run_or_record(op)

    def draft(self, bonus, start_pos, ctx_len, out):
        def op():
            assert all(int(c) == int(s) for c, s in zip(ctx_len, start_pos))
            np.asarray(out).view(np.ndarray)[...] = oracle_draft_logits(self.rng, self.seqs, start_pos, out.shape,
                                                                        off_chain_every=3)
        run_or_record(op)
        return out


def main():
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    from ddtree_cupy.reference.loop import DecodeLoop, Request
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    tdir, _ = ensure_tiny_checkpoints()
    cfg = TargetConfig.load(tdir)
    ref = ReferenceTarget(cfg, load_reference_weights(tdir, np.float64, cfg=cfg), np.float64)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 700, n).tolist() for n in (5, 40)]
    n_new = 14
    want = [s.output_ids for s in DecodeLoop(ref, None, "ar", 1).run([Request(p, n_new) for p in prompts]).streams]
    from types import SimpleNamespace
    from ddtree_cupy.config import DrafterConfig
    from ddtree_cupy.models import drafter as md
    md.GpuDrafter = OracleGpuDrafter
    md.GpuDrafterWeights.from_checkpoint = staticmethod(lambda *a, **k: SimpleNamespace())
    OracleGpuDrafter.seqs = {i: list(p) + list(w) for i, (p, w) in enumerate(zip(prompts, want))}
    _, ddir = ensure_tiny_checkpoints()
    dcfg = DrafterConfig.load(ddir)
    for mode, budget in (("ar", 1), ("ddtree", 16), ("chain", 8)):
        got = {}
        for eager in (False, True):
            eng = GpuEngine(cfg, tdir, dcfg, ddir, max_streams=2, max_budget=16, kv_tokens=64 * 8, max_context=256,
                            prefill_chunk=32, eager=eager)
            res = eng.generate([Request(p, n_new) for p in prompts], mode, budget)
            got[eager] = [s.output_ids for s in res.streams]
            assert eng.last_pool.free_pages == eng.last_pool.num_pages
            if not eager:
                assert all(st.graph is not None for st in eng.steps.values()) and eng.prefill_runner.graph
            print(f"{mode} eager={eager}: accept lens {res.accept_lens}, drafter rows appended "
                  f"{eng.drafter.appended}")
            if mode == "ddtree":
                assert max(res.accept_lens) >= 4, res.accept_lens
        assert got[False] == got[True], (mode, got)
        for p, g, w in zip(prompts, got[False], want):
            for i, (a, b) in enumerate(zip(g, w)):
                if a != b:
                    logits, _ = ref.forward(np.asarray(p + w[:i], np.int64), np.arange(len(p) + i), ref.new_cache())
                    lg = logits[-1]
                    gap = lg[b] - lg[a]
                    assert gap < 5e-2 * lg.std(), (mode, i, a, b, gap / lg.std())
                    print(f"{mode}: near-tie at token {i}")
                    break
            else:
                assert len(g) == len(w)
        print(mode, "tokens", got[False], "reference", want)
    print("ENGINE-EMUL OK")


if __name__ == "__main__":
    main()
