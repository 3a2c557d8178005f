"""The GPU engine's CPU stand-ins for the target and the drafter (toy models with GpuTarget's / GpuDrafter's
interfaces over the paged cache) and their reference-interface twins, with the ``fake_gpu`` fixture that puts
them, the CuPy stand-in (tests/_fake_cupy.py) and the step's kernel emulations (tests/_kernel_emul.py) in place
for one test. Users: tests/test_engine_cpu.py, tests/test_profiling.py, tests/test_budget_engine_cpu.py.

The toy target's next-token choice depends on every token it can see (the paged cache through the block table
plus the tree rows its ancestor mask allows), and the toy drafter proposes the true continuation with
deliberate mistakes, so trees branch, walks accept several nodes and the KV compaction matters."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import _fake_cupy as fake
import _kernel_emul
from _fake_cupy import run_or_record

from ddtree_cupy.reference.loop import Request
from ddtree_cupy.tinymodel import TinySpec


# ---------------------------------------------------------------------------------------------------
# toy models: the GPU-side stand-ins and their reference-interface twins
# ---------------------------------------------------------------------------------------------------
def toy_next_logits(ctx, V):
    """A deterministic 'LM' whose argmax depends on the last two tokens and the context length."""
    t1 = ctx[-1] if len(ctx) else 0
    t2 = ctx[-2] if len(ctx) > 1 else 0
    target = (31 * int(t1) + 17 * int(t2) + 7 * len(ctx) + 3) % V
    return (-1.0 * ((np.arange(V) - target) % V)).astype(np.float32)


def toy_draft_logits(ctx, bonus, s, D, V):
    """The true greedy continuation, except that at positions with (s + d) % 3 == 0 the top-1 is a wrong
    token and the right one is ranked second (the tree must branch to accept it)."""
    seq = list(ctx) + [int(bonus)]
    out = np.zeros((D, V), np.float32)
    for d in range(1, D + 1):
        lg = toy_next_logits(seq, V)
        t = int(np.argmax(lg))
        if (s + d) % 3 == 0:
            lg = lg.copy()
            lg[(t + 5) % V] = lg[t] + 0.5
        out[d - 1] = lg
        seq.append(t)
    return out


class ToyCache:
    def __init__(self):
        self.tokens = []

    @property
    def length(self):
        return len(self.tokens)

    def commit(self, prefix_len, rows):
        self.tokens = self.tokens[:prefix_len] + [self.tokens[r] for r in rows]


class ToyRefTarget:
    def __init__(self, cfg, n_feat, H):
        self.cfg, self.n_feat, self.H = cfg, n_feat, H

    def new_cache(self):
        return ToyCache()

    def forward(self, tokens, positions, cache, visible=None, capture_layers=()):
        T, V = len(tokens), self.cfg.vocab_size
        before = list(cache.tokens)
        vis = np.tril(np.ones((T, T), bool)) if visible is None else np.asarray(visible)
        logits = np.stack([toy_next_logits(before + [int(tokens[j]) for j in range(T) if vis[i, j]], V)
                           for i in range(T)])
        cache.tokens += [int(t) for t in tokens]
        feats = np.zeros((T, len(capture_layers), self.H), np.float32)
        if len(capture_layers):
            feats[:, 0, 0] = tokens
        return logits, feats


class ToyRefDrafter:
    def __init__(self, dcfg, V):
        self.block_size, self.target_layer_ids, self.V = dcfg.block_size, dcfg.target_layer_ids, V

    def new_cache(self):
        return {}

    def append_context(self, cache, feats, positions, tokens):
        for p, t in zip(positions, tokens):
            cache[int(p)] = int(t)

    def draft(self, cache, bonus, s):
        return toy_draft_logits([cache[p] for p in range(s)], bonus, s, self.block_size - 1, self.V)


class FakeGpuTarget:
    """GpuTarget's interface over the paged latent cache: writes each row's token into every layer's pool at
    kv_pos (through the block table), and computes logits from exactly what the attention would see."""

    def __init__(self, cfg, w, comm=None, max_tokens=256, feature_layers=()):
        self.cfg, self.comm, self.max_tokens = cfg, comm, max_tokens
        self.feature_layers = tuple(feature_layers)
        self.w = w
        self.calls = 0

    def _slice(self, full):
        """This rank's vocabulary columns (TP: the lm_head is split by vocabulary)."""
        size = getattr(self.comm, "size", 1) if self.comm is not None else 1
        rank = getattr(self.comm, "rank", 0) if self.comm is not None else 0
        n = full.shape[-1] // size
        return full[..., rank * n:(rank + 1) * n]

    def forward(self, batch, kv):
        assert batch.T <= self.max_tokens and batch.n_feat == len(self.feature_layers)
        run_or_record(lambda: self._forward(batch, kv))

    def _forward(self, b, kv):
        self.calls += 1
        V, R = self.cfg.vocab_size, b.R
        bt = np.asarray(kv.block_table)
        for s in range(b.S):
            n = int(b.n_rows[s])
            base = s * R
            for r in range(R):
                p = int(b.kv_pos[base + r])
                if p >= 0:
                    assert r < n
                    for pool in kv.pools:
                        pool[bt[s, p // 64], p % 64, 0] = b.tokens[base + r]
            for r in range(R):
                row = base + r
                if r >= n:
                    b.logits[row] = 0
                    continue
                pre = int(b.prefix_len[s])
                ctx = [int(kv.pools[0][bt[s, q // 64], q % 64, 0]) for q in range(pre)]
                if b.mask is None:
                    vis = range(r + 1)
                else:
                    words = np.asarray(b.mask[s, r])
                    vis = [j for j in range(R) if (int(words[j // 32]) >> (j % 32)) & 1]
                ctx += [int(b.tokens[base + j]) for j in vis]
                b.logits[row] = self._slice(toy_next_logits(ctx, V))
            if b.n_feat:
                b.features[base:base + R] = 0
                b.features[base:base + R, 0, 0] = b.tokens[base:base + R]


class FakeGpuDrafter:
    def __init__(self, dcfg, w, target, comm=None, max_streams=1, max_ctx=4096, max_append=64):
        self.cfg, self.S, self.C, self.N_max = dcfg, max_streams, max_ctx, max_append
        self.ctx = np.full((max_streams, max_ctx), -1, np.int64)
        self.V = target.cfg.vocab_size
        self.target = target
        self.k_cache, self.v_cache = [], []

    def append_context(self, feats, stream_ids, positions):
        assert feats.shape[0] <= self.N_max
        run_or_record(lambda: self._append(feats, stream_ids, positions))

    def _append(self, feats, sid, pos):
        for i in range(feats.shape[0]):
            if pos[i] >= 0:
                self.ctx[sid[i], pos[i] % self.C] = feats[i, 0, 0]

    def draft(self, bonus, start_pos, ctx_len, out):
        run_or_record(lambda: self._draft(bonus, start_pos, ctx_len, out))
        return out

    def _draft(self, bonus, start, clen, out):
        D = self.cfg.block_size - 1
        for b in range(out.shape[0]):
            n = int(clen[b])
            ctx = [int(self.ctx[b, p % self.C]) for p in range(n)]
            assert all(t >= 0 for t in ctx), "drafter context has a hole"
            out[b] = self.target._slice(toy_draft_logits(ctx, int(bonus[b]), int(start[b]), D, self.V))


# ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def fake_gpu(monkeypatch):
    fake.patch_modules(monkeypatch)
    from ddtree_cupy.kernels import ddtree as kd
    from ddtree_cupy.kernels import engine_glue as kg
    from ddtree_cupy.kernels import kv_cache as kk
    from ddtree_cupy.models import drafter as md
    from ddtree_cupy.models import target as mt
    from ddtree_cupy.models import weights as mw
    _kernel_emul.patch_get_kernel((kd, kg, kk), monkeypatch.setattr)
    monkeypatch.setattr(mw.GpuTargetWeights, "random", staticmethod(lambda *a, **k: SimpleNamespace(nbytes=lambda: 0)))
    monkeypatch.setattr(md.GpuDrafterWeights, "random", staticmethod(lambda *a, **k: SimpleNamespace(nbytes=0)))
    monkeypatch.setattr(mt, "GpuTarget", FakeGpuTarget)
    monkeypatch.setattr(md, "GpuDrafter", FakeGpuDrafter)
    yield


SPEC = TinySpec(max_position_embeddings=160)


def make(max_streams=4, max_budget=12, kv_tokens=64 * 40, eager=False):
    from ddtree_cupy.engine.gpu_engine import GpuEngine
    tcfg, dcfg = SPEC.target_config(), SPEC.drafter_config()
    eng = GpuEngine(tcfg, None, dcfg, None, max_streams=max_streams, max_budget=max_budget, kv_tokens=kv_tokens,
                    eager=eager, random_weights=0, prefill_chunk=32)
    ref_t = ToyRefTarget(SimpleNamespace(vocab_size=tcfg.vocab_size,
                                         max_position_embeddings=tcfg.max_position_embeddings),
                         len(dcfg.target_layer_ids), tcfg.hidden_size)
    return eng, ref_t, ToyRefDrafter(dcfg, tcfg.vocab_size)


def reqs(lens=(3, 40, 70, 9), n_new=(50, 30, 200, 12), stop=None):
    rng = np.random.default_rng(1)
    return [Request(rng.integers(0, 700, n).tolist(), m, stop_ids=stop or (), sample_stream=i)
            for i, (n, m) in enumerate(zip(lens, n_new))]
