"""Decode loop (numpy reference): lossless greedy decoding in every mode, acceptance with oracle and wrong
drafters, stop/length/context handling, and sampling (reproducible, and distributed like the target)."""
from __future__ import annotations

import functools
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from _specs import SMALL_256 as SMALL

from ddtree_cupy.checkpoint import load_drafter_weights, load_reference_weights
from ddtree_cupy.config import DrafterConfig, TargetConfig
from ddtree_cupy.reference.drafter import ReferenceDrafter
from ddtree_cupy.reference.loop import DecodeLoop, Request, generate
from ddtree_cupy.reference.target import ReferenceTarget
from ddtree_cupy.tinymodel import TinySpec, ensure_tiny_checkpoints


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_loop"))


@functools.lru_cache(maxsize=None)
def _models(cache_dir, seed, dtype_name="float64", spec=SMALL):
    dtype = np.dtype(dtype_name)
    td, dd = ensure_tiny_checkpoints(cache_dir, seed=seed, spec=spec)
    tw = load_reference_weights(td, dtype)
    tgt = ReferenceTarget(TargetConfig.load(td), tw, dtype)
    dr = ReferenceDrafter(DrafterConfig.load(dd), load_drafter_weights(dd, dtype), tw["model.embed_tokens.weight"],
                          tw["lm_head.weight"], dtype)
    return tgt, dr


def prompts(n, seed, vocab=SMALL.vocab_size - 256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, 3 + 7 * i).tolist() for i in range(n)]


def run(tgt, dr, ps, mode, budget=8, n_new=104, **kw):
    req_kw = {k: kw.pop(k) for k in list(kw) if k in ("temperature", "top_p", "top_k", "seed", "stop_ids")}
    reqs = [Request(p, max_new_tokens=n_new, sample_stream=i, **req_kw) for i, p in enumerate(ps)]
    return generate(tgt, dr, reqs, mode=mode, budget=budget, **kw)


def outputs(res):
    return [s.output_ids for s in res.streams]


# ---------------- test drafters with the DFlash drafter's interface ----------------------------------

class OracleDrafter:
    """Drafts from the TARGET itself: the target's greedy continuation after the bonus token.

    kind = 'onehot': the greedy token at each depth gets log-prob ~0, everything else -30 (a perfect drafter);
           'logits': the target's own logits along its greedy continuation (+ ``noise`` * N(0,1) if given),
                     so lower ranks are the target's other likely tokens;
           'wrong':  the greedy token is ranked LAST at every depth (it never enters a top-K < V)."""

    def __init__(self, target, block_size=8, kind="onehot", noise=0.0, seed=0):
        self.t, self.block_size, self.kind, self.noise, self.seed = target, block_size, kind, noise, seed
        self.target_layer_ids = (0,)

    def new_cache(self):
        return SimpleNamespace(tc=self.t.new_cache())

    def append_context(self, cache, feats, positions, tokens):
        self.t.forward(np.asarray(tokens, np.int64), np.asarray(positions, np.int64), cache.tc)

    def draft(self, cache, bonus, s):
        n0, V, D = cache.tc.length, self.t.cfg.vocab_size, self.block_size - 1
        assert n0 == s, "drafter context must hold exactly the committed tokens"
        out = np.empty((D, V))
        tok = bonus
        for d in range(D):
            lg, _ = self.t.forward(np.array([tok]), np.array([s + d]), cache.tc)
            g = int(np.argmax(lg[0]))
            if self.kind == "onehot":
                out[d] = -30.0
                out[d, g] = 0.0
            elif self.kind == "wrong":
                out[d] = np.random.default_rng(s * 31 + d).standard_normal(V)
                out[d, g] = -1e4
            else:
                out[d] = lg[0] + self.noise * np.random.default_rng((self.seed, s, d)).standard_normal(V)
            tok = g
        cache.tc.truncate(n0)
        return out


# ---------------- lossless greedy decoding ------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _ar(cache_dir, seed, n_streams, pseed):
    tgt, dr = _models(cache_dir, seed)
    return outputs(run(tgt, dr, prompts(n_streams, pseed), "ar"))


@pytest.mark.parametrize("seed,mode,budget,n_streams,extra", [
    (0, "chain", 7, 1, {}),
    (0, "ddtree", 1, 2, {}),
    (0, "ddtree", 8, 3, {}),
    (1, "ddtree", 64, 4, {}),
    (1, "ddtree", 5, 2, {"cap_k": 2, "include_chain": True}),
    (2, "ddtree", 32, 2, {"include_chain": True}),
    (2, "chain", 7, 3, {}),
])
def test_lossless_dflash_drafter(ckpt_dir, seed, mode, budget, n_streams, extra):
    tgt, dr = _models(ckpt_dir, seed)
    ps = prompts(n_streams, seed + 10)
    res = run(tgt, dr, ps, mode, budget, **extra)
    ref = _ar(ckpt_dir, seed, n_streams, seed + 10)
    assert outputs(res) == ref
    assert all(len(o) == 104 for o in ref)
    assert all(s.finish_reason == "length" for s in res.streams)
    assert 1 <= min(res.accept_lens) and max(res.accept_lens) <= dr.block_size
    if mode == "ddtree":
        assert max(res.tree_sizes) <= budget
    else:
        assert set(res.tree_sizes) == {dr.block_size - 1}


def test_lossless_with_branching_trees(ckpt_dir):
    """A noisy oracle puts the target's choice at rank 0 often, at lower ranks sometimes: the tree walk then
    accepts paths through rank > 0 nodes, which a chain cannot. Output must still be exactly AR's."""
    tgt, _ = _models(ckpt_dir, 0)
    ps = prompts(2, 3)
    ref = _ar(ckpt_dir, 0, 2, 3)
    accept = {}
    for mode, budget in (("chain", 7), ("ddtree", 4), ("ddtree", 64)):
        dr = OracleDrafter(tgt, kind="logits", noise=2.0)
        res = run(tgt, dr, ps, mode, budget, n_new=64)
        assert outputs(res) == [o[:64] for o in ref], (mode, budget)
        accept[(mode, budget)] = res.mean_accept_len
    assert accept[("ddtree", 64)] > accept[("chain", 7)] > 1.2
    assert accept[("ddtree", 64)] > accept[("ddtree", 4)]


def test_lossless_float32(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 1, "float32")
    ps = prompts(2, 5)
    assert outputs(run(tgt, dr, ps, "ddtree", 16)) == outputs(run(tgt, dr, ps, "ar"))


def test_oracle_drafter_accepts_whole_blocks(ckpt_dir):
    tgt, _ = _models(ckpt_dir, 2)
    ps = prompts(2, 7)
    ref = _ar(ckpt_dir, 2, 2, 7)
    for mode, budget, expect in (("chain", 7, 8), ("ddtree", 20, 8), ("ddtree", 3, 4)):
        res = run(tgt, OracleDrafter(tgt), ps, mode, budget)
        assert outputs(res) == ref
        assert res.accept_lens == [expect] * len(res.accept_lens), (mode, budget)
        # every step emits `expect` tokens; the first comes from prefill
        assert res.steps == math.ceil((104 - 1) / expect)


def test_wrong_drafter_accepts_only_the_root(ckpt_dir):
    tgt, _ = _models(ckpt_dir, 2)
    ps = prompts(2, 7)
    for mode, budget in (("chain", 7), ("ddtree", 64)):
        res = run(tgt, OracleDrafter(tgt, kind="wrong"), ps, mode, budget, n_new=40)
        assert outputs(res) == [o[:40] for o in _ar(ckpt_dir, 2, 2, 7)]
        assert set(res.accept_lens) == {1}
        assert res.steps == 39


class OracleWithDFlashContext(OracleDrafter):
    """Drafts like the noisy oracle (so rounds accept several rows, through rank > 0 nodes too) while also
    feeding a real DFlash drafter's context cache exactly as the loop feeds it."""

    def __init__(self, target, dflash):
        super().__init__(target, kind="logits", noise=2.0)
        self.dflash = dflash
        self.target_layer_ids = dflash.target_layer_ids

    def new_cache(self):
        c = super().new_cache()
        c.dc = self.dflash.new_cache()
        return c

    def append_context(self, cache, feats, positions, tokens):
        super().append_context(cache, feats, positions, tokens)
        self.dflash.append_context(cache.dc, feats, positions, tokens)


def test_drafter_context_matches_fresh_prefill(ckpt_dir):
    """After decoding, each stream's drafter context must hold the features of exactly the committed tokens
    at their positions: the same K/V a drafter gets from one target prefill over prompt + committed output."""
    tgt, dr = _models(ckpt_dir, 0)
    res = DecodeLoop(tgt, OracleWithDFlashContext(tgt, dr), "ddtree", 16).run(
        [Request(p, 30) for p in prompts(2, 21)])
    for s in res.streams:
        assert max(s.accept_lens) > 1 and s.committed > len(s.request.prompt_ids)
        # committed = prompt + accepted tokens; the emitted output may stop earlier (max_new_tokens cut a
        # round short) or run one token further (the pending bonus)
        seq, P = s.drafter_cache.dc.tokens, len(s.request.prompt_ids)
        assert len(seq) == s.committed and seq[:P] == list(s.request.prompt_ids)
        k = min(len(seq) - P, len(s.output_ids))
        assert seq[P:P + k] == s.output_ids[:k]
        _, feats = tgt.forward(np.array(seq), np.arange(len(seq)), tgt.new_cache(), capture_layers=dr.target_layer_ids)
        fresh = dr.new_cache()
        dr.append_context(fresh, feats, np.arange(len(seq)))
        got, n = s.drafter_cache.dc, len(seq)
        assert got.length == n
        for l in range(dr.cfg.num_hidden_layers):
            np.testing.assert_allclose(got.k[l][:n], fresh.k[l][:n], rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(got.v[l][:n], fresh.v[l][:n], rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(got.positions[:n], np.arange(n))
        assert s.drafter_cache.tc.length == n     # the oracle's own context: committed tokens only


def test_streams_are_independent(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 0)
    ps = prompts(3, 11)
    together = outputs(run(tgt, dr, ps, "ddtree", 16, n_new=40))
    alone = [outputs(run(tgt, dr, [p], "ddtree", 16, n_new=40))[0] for p in ps]
    assert together == alone


# ---------------- stop conditions ------------------------------------------------------------------

def test_stop_ids_and_max_tokens(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 0)
    ps = prompts(1, 3)
    ref = _ar(ckpt_dir, 0, 1, 3)[0]
    stop = ref[20]
    cut = ref[:ref.index(stop) + 1]
    for mode in ("ar", "chain", "ddtree"):
        res = run(tgt, OracleDrafter(tgt), ps, mode, 16, stop_ids=(stop,))
        assert outputs(res)[0] == cut and res.streams[0].finish_reason == "stop"
        res = run(tgt, OracleDrafter(tgt), ps, mode, 16, n_new=13)
        assert outputs(res)[0] == ref[:13] and res.streams[0].finish_reason == "length"
    # the first token (from prefill) can already finish the request
    res = run(tgt, dr, ps, "ddtree", 16, n_new=1)
    assert outputs(res)[0] == ref[:1] and res.steps == 0
    res = run(tgt, dr, ps, "ddtree", 16, stop_ids=(ref[0],))
    assert outputs(res)[0] == ref[:1] and res.streams[0].finish_reason == "stop"


def test_context_limit(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 0)
    limit = SMALL.max_position_embeddings
    p = prompts(1, 4)[0] * 200
    p = p[:limit - 20]
    ar = run(tgt, dr, [p], "ar", n_new=100)
    tree = run(tgt, OracleDrafter(tgt), [p], "ddtree", 16, n_new=100)
    for res, depth in ((ar, 0), (tree, 7)):
        st = res.streams[0]
        assert st.finish_reason == "context"
        # every verify row stayed below the limit, and no room was left for another round
        assert st.committed + depth >= limit and st.committed <= limit
        assert res.steps == st.steps          # the round that found no room is not counted
    assert outputs(tree)[0] == outputs(ar)[0][:len(outputs(tree)[0])]


def test_bad_requests(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 0)
    cases = [(Request([]), "prompt is empty"), (Request([1, 512]), r"outside the vocabulary \[0, 512\)"),
             (Request([-1]), "outside the vocabulary"), (Request([1] * 256), "context limit is 256"),
             (Request([1], max_new_tokens=0), "max_new_tokens"), (Request([1], top_p=0.0), "top_p"),
             (Request([1], top_k=-1), "top_k")]
    for req, msg in cases:
        with pytest.raises(ValueError, match=msg):
            generate(tgt, dr, [req], "ddtree", 8)
    with pytest.raises(ValueError, match="budget"):
        DecodeLoop(tgt, dr, "ddtree", 129)
    with pytest.raises(ValueError, match="budget"):
        DecodeLoop(tgt, dr, "ddtree", 0)
    with pytest.raises(ValueError, match="unknown mode 'beam'"):
        DecodeLoop(tgt, dr, "beam", 8)
    with pytest.raises(ValueError, match="needs a drafter"):
        DecodeLoop(tgt, None, "chain", 8)
    with pytest.raises(ValueError, match="block_size 16"):
        DecodeLoop(tgt, OracleDrafter(tgt, block_size=16), "ddtree", 8)


def test_statistics(ckpt_dir):
    tgt, _ = _models(ckpt_dir, 0)
    res = run(tgt, OracleDrafter(tgt, kind="logits", noise=2.0), prompts(2, 3), "ddtree", 16, n_new=30)
    st = res.stats_dict()
    # all streams start together, so the batch ran as many steps as its longest-running stream
    assert st["steps"] == res.steps == max(s.steps for s in res.streams)
    assert len(st["accept_lens"]) == sum(s.steps for s in res.streams)
    assert st["mean_accept_len"] == pytest.approx(np.mean(st["accept_lens"]))
    assert st["new_tokens"] == 60 and st["tokens_per_s"] > 0
    assert set(st["phase_ms"]) == {"prefill", "draft", "tree", "verify", "accept"}
    assert all(v >= 0 for v in st["phase_ms"].values()) and st["phase_ms"]["verify"] > 0
    # per stream: emitted = 1 (prefill) + sum of acceptance lengths, cut at max_new_tokens
    for s in res.streams:
        assert len(s.output_ids) == min(30, 1 + sum(s.accept_lens))


# ---------------- sampling ------------------------------------------------------------------------

def test_sampling_is_reproducible(ckpt_dir):
    tgt, dr = _models(ckpt_dir, 1)
    ps = prompts(2, 9)
    kw = dict(temperature=0.8, top_p=0.9, top_k=50, n_new=40)
    a = outputs(run(tgt, dr, ps, "ddtree", 16, seed=7, **kw))
    assert a == outputs(run(tgt, dr, ps, "ddtree", 16, seed=7, **kw))
    assert a != outputs(run(tgt, dr, ps, "ddtree", 16, seed=8, **kw))
    assert a[0] != a[1] or ps[0] == ps[1]
    # a stream's randomness is its own (seed, sample_stream): batching does not change it
    alone = generate(tgt, dr, [Request(ps[1], 40, temperature=0.8, top_p=0.9, top_k=50, seed=7, sample_stream=1)],
                     "ddtree", 16)
    assert outputs(alone)[0] == a[1]


def chi2_sf(x, k):
    """P(chi2_k > x) for integer k (closed forms: Poisson sum for even k, erfc plus half-integer terms for odd)."""
    h = x / 2.0
    if k % 2 == 0:
        return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(k // 2))
    s = math.erfc(math.sqrt(h))
    for i in range(1, (k + 1) // 2):
        s += math.exp(-h + (i - 0.5) * math.log(h) - math.lgamma(i + 0.5)) if h > 0 else 0.0
    return s


def pooled_chi2(counts, exact, n):
    """Chi-square of ``n`` sampled outcomes (``counts``: outcome -> times drawn) against their exact
    probabilities, outcomes expecting fewer than 5 draws pooled into one cell. Returns (statistic, observed
    cells, expected cells)."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in sorted(exact, key=exact.get, reverse=True):
        if exact[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(exact[c] * n)
        else:
            pool_o += counts.get(c, 0)
            pool_e += exact[c] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), obs, exp


def test_chi2_sf_known_values():
    # table values: chi2_{0.05} critical points
    for k, crit in ((1, 3.841459), (2, 5.991465), (5, 11.070498), (10, 18.307038)):
        assert chi2_sf(crit, k) == pytest.approx(0.05, rel=1e-5)


def exact_triples(tgt, prompt, temperature, top_k):
    """Exact probability of every 3-token continuation under the target with temperature / top-k filtering."""
    def dist(seq):
        c = tgt.new_cache()
        lg, _ = tgt.forward(np.array(seq), np.arange(len(seq)), c)
        z = lg[-1].astype(np.float64) / temperature
        keep = np.lexsort((np.arange(z.size), -z))[:top_k]
        p = np.exp(z[keep] - z[keep].max())
        return dict(zip(keep.tolist(), (p / p.sum()).tolist()))
    out = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                out[(a, b, c)] = pa * pb * pc
    return out


def test_sampling_matches_target_distribution(ckpt_dir):
    """Sampled 3-token continuations in 'ar' and in 'ddtree' mode (with a drafter that makes the tree walk
    accept multi-token paths) against the exact target distribution, chi-square goodness of fit. Cells with
    expectation < 5 are pooled. Each test has a false-alarm rate of 1e-3 per fresh seed set; the seeds
    here are fixed, so the outcome is deterministic."""
    tgt, _ = _models(ckpt_dir, 3)
    prompt = prompts(1, 13)[0][:4]
    T, K, N = 1.3, 3, 300
    exact = exact_triples(tgt, prompt, T, K)
    assert abs(sum(exact.values()) - 1) < 1e-12
    for mode in ("ar", "ddtree"):
        dr = OracleDrafter(tgt, block_size=4, kind="logits")
        loop_reqs = [Request(prompt, 3, temperature=T, top_k=K, seed=1000 + i) for i in range(N)]
        res = generate(tgt, dr, loop_reqs, mode, 8)
        counts = Counter(tuple(s.output_ids) for s in res.streams)
        assert set(counts) <= set(exact)
        if mode == "ddtree":
            assert res.mean_accept_len > 1.5     # the walk really took multi-token paths
        stat, obs, exp = pooled_chi2(counts, exact, N)
        assert len(obs) >= 4
        p = chi2_sf(stat, len(obs) - 1)
        assert p > 1e-3, (mode, stat, p, obs, exp)


@pytest.mark.slow
def test_lossless_default_tiny_model_float32(tmp_path_factory):
    """The demo's model (real kernel dims: kv_lora 512, rope 64, head_dim 128, 32 experts) in float32."""
    d = str(tmp_path_factory.mktemp("tiny_default"))
    tgt, dr = _models(d, 0, "float32", TinySpec())
    ps = [[11, 12, 13], list(range(40, 70))]
    ar = outputs(run(tgt, dr, ps, "ar", n_new=20))
    assert outputs(run(tgt, dr, ps, "ddtree", 32, n_new=20)) == ar
    assert outputs(run(tgt, OracleDrafter(tgt, kind="logits", noise=1.0), ps, "ddtree", 32, n_new=20)) == ar
