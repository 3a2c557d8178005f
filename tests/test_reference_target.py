"""The numpy reference target: against HF transformers' DeepseekV3 (oracle), and self-consistency
(absorbed == naive MLA, tree verify == per-path causal runs, decode == prefill, float32 ~ float64),
plus the standalone pieces (RMSNorm, RoPE, routing, experts, the latent cache)."""
from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hf_oracle import (float64_exact, hf_cache_rows, hf_forward, build_hf_model,  # noqa: E402
                       random_target_weights, tiny_target_config)

from ddtree_cupy.config import RopeConfig  # noqa: E402
from ddtree_cupy.reference import (LatentKVCache, ReferenceTarget, apply_rope_adjacent,  # noqa: E402
                                   apply_rope_rotate_half, latent_attention, mla_attention_absorbed,
                                   mla_attention_naive, moe_experts, rms_norm, route, split_kv_b,
                                   swiglu_mlp, yarn_inv_freq)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread():
    """HF runs on one thread here: on a shared 2-core box torch's thread pool oversubscribes the cores and
    the oracle runs several times slower. Restored afterwards (other test modules keep their setting)."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cfg():
    return tiny_target_config()


@pytest.fixture(scope="module")
def weights(cfg):
    return random_target_weights(cfg, seed=1)


@pytest.fixture(scope="module")
def ref64(cfg, weights):
    return ReferenceTarget(cfg, weights, dtype=np.float64)


def random_tree(rng, n_nodes):
    """Row 0 = root; node i's parent is a random earlier row. Returns parents, depths, ancestor-or-self mask."""
    parents = np.full(n_nodes, -1)
    depths = np.zeros(n_nodes, np.int64)
    vis = np.eye(n_nodes, dtype=bool)
    for i in range(1, n_nodes):
        parents[i] = rng.integers(0, i)
        depths[i] = depths[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    return parents, depths, vis


def path_to(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


# ==================================================================================================
# oracle: HF transformers DeepseekV3ForCausalLM, same config and weights

@pytest.fixture(scope="module")
def hf_model(cfg, weights):
    return build_hf_model(cfg, weights)


# "as_is": HF exactly as shipped (it rounds RMSNorm, router, softmax and RoPE angles through float32);
# "exact": the same HF code with float32 remapped to float64, which pins every index/convention to ~1e-14.
HF_MODES = [("as_is", 1e-6), ("exact", 1e-11)]


def _hf_mode(mode, model, cfg):
    if mode == "exact":
        return float64_exact(model, yarn_inv_freq(cfg.rope, cfg.qk_rope_head_dim))
    import contextlib
    return contextlib.nullcontext(model)


@pytest.mark.oracle
@pytest.mark.parametrize("mode,tol", HF_MODES)
def test_oracle_prefill_then_decode(cfg, weights, ref64, hf_model, mode, tol):
    rng = np.random.default_rng(11)
    n0, steps = 20, 4
    toks = rng.integers(0, cfg.vocab_size, n0 + steps)
    cache = ref64.new_cache()
    caps = tuple(range(cfg.num_hidden_layers))
    with _hf_mode(mode, hf_model, cfg) as m:
        lg, feats = ref64.forward(toks[:n0], np.arange(n0), cache, capture_layers=caps)
        hl, hs, hc = hf_forward(m, toks[:n0], np.arange(n0))
        assert rel(lg, hl) <= tol
        # residual stream after each layer: HF hidden_states[i + 1], except that HF's last entry is after the
        # final norm (5.x records the normed output there), so compare that one through the norm
        for i in caps[:-1]:
            assert rel(feats[:, i], hs[i + 1]) <= tol, f"layer {i} features"
        last = rms_norm(feats[:, -1], weights["model.norm.weight"], cfg.rms_norm_eps)
        assert rel(last, hs[-1]) <= tol
        for t in range(n0, n0 + steps):
            lg1, _ = ref64.forward(toks[t:t + 1], np.array([t]), cache)
            hl1, _, hc = hf_forward(m, toks[t:t + 1], np.array([t]), cache=hc, past_len=t)
            assert rel(lg1, hl1) <= tol, f"decode step at position {t}"
        for layer in range(cfg.num_hidden_layers):
            assert rel(cache.layer(layer), hf_cache_rows(hc, layer)) <= tol, f"latent cache of layer {layer}"
    assert cache.length == n0 + steps


@pytest.mark.oracle
@pytest.mark.parametrize("mode,tol", HF_MODES)
def test_oracle_tree_verify(cfg, ref64, hf_model, mode, tol):
    rng = np.random.default_rng(12)
    s, n = 14, 12
    prefix = rng.integers(0, cfg.vocab_size, s)
    parents, depths, vis = random_tree(rng, n)
    tree_toks = rng.integers(0, cfg.vocab_size, n)
    with _hf_mode(mode, hf_model, cfg) as m:
        cache = ref64.new_cache()
        ref64.forward(prefix, np.arange(s), cache)
        _, _, hc = hf_forward(m, prefix, np.arange(s))
        lg, _ = ref64.forward(tree_toks, s + depths, cache, visible=vis)
        hl, _, hc = hf_forward(m, tree_toks, s + depths, cache=hc, visible=vis, past_len=s)
        assert rel(lg, hl) <= tol
        for layer in range(cfg.num_hidden_layers):
            assert rel(cache.layer(layer), hf_cache_rows(hc, layer)) <= tol


@pytest.mark.oracle
def test_oracle_conventions(cfg, hf_model):
    """The conventions the reference follows, as HF transformers implements DeepseekV3 in this version."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hc = hf_model.config
    assert hc.rope_interleave is True                      # adjacent-pair RoPE is HF's default for DeepseekV3
    attn = hf_model.model.layers[0].self_attn
    assert attn.q_a_layernorm.variance_epsilon == 1e-6     # latent norms: fixed 1e-6, not rms_norm_eps
    assert attn.kv_a_layernorm.variance_epsilon == 1e-6
    assert cfg.latent_norm_eps == 1e-6
    assert hf_model.model.layers[0].input_layernorm.variance_epsilon == cfg.rms_norm_eps
    assert math.isclose(attn.scaling, cfg.softmax_scale, rel_tol=1e-15)
    assert math.isclose(cfg.softmax_scale, 0.14467963, rel_tol=1e-7)
    inv, amp = ROPE_INIT_FUNCTIONS["yarn"](hc)
    assert amp == cfg.rope.amplitude == 1.0
    ours = yarn_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    # HF builds inv_freq in float32: agreement to float32 rounding (a shifted ramp would be off by ~1e-1)
    assert inv.dtype == torch.float32
    assert np.max(np.abs(inv.numpy() / ours - 1)) < 1e-6


@pytest.mark.oracle
@pytest.mark.parametrize("scaling", [
    {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},                  # K2-Thinking / K2-0905
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707},                # mscale != mscale_all_dim
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0,
     "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 1.0},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},  # no mscale keys: amplitude 1.208
    None,                                                                       # plain RoPE
])
def test_yarn_inv_freq_and_amplitude_match_hf(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from hf_oracle import hf_config
    cfg = tiny_target_config(rope_scaling=scaling, rope_theta=10000.0 if scaling is None else 50000.0)
    hc = hf_config(cfg)
    ours = yarn_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    if scaling is None:
        from transformers import DeepseekV3Model
        inv, amp = DeepseekV3Model(hc).rotary_emb.compute_default_rope_parameters(hc)
    else:
        inv, amp = ROPE_INIT_FUNCTIONS["yarn"](hc)
    assert np.max(np.abs(inv.numpy() / ours - 1)) < 1e-6
    assert math.isclose(amp, cfg.rope.amplitude, rel_tol=1e-12)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    assert math.isclose(DeepseekV3Attention(hc, 0).scaling, cfg.softmax_scale, rel_tol=1e-12)


# ==================================================================================================
# self-consistency of the model

def test_absorbed_mla_equals_naive_in_model(cfg, weights, ref64):
    naive = ReferenceTarget(cfg, weights, dtype=np.float64, attention="naive")
    rng = np.random.default_rng(3)
    toks = rng.integers(0, cfg.vocab_size, 9)
    c1, c2 = ref64.new_cache(), naive.new_cache()
    a, fa = ref64.forward(toks, np.arange(9), c1, capture_layers=(1, 3))
    b, fb = naive.forward(toks, np.arange(9), c2, capture_layers=(1, 3))
    assert rel(a, b) <= 1e-10 and rel(fa, fb) <= 1e-10
    # layer 0's cache rows come before any attention: bit-identical; later layers differ by rounding only
    assert np.array_equal(c1.layer(0), c2.layer(0))
    for layer in range(1, cfg.num_hidden_layers):
        assert rel(c1.layer(layer), c2.layer(layer)) <= 1e-10
    assert ref64.embed_tokens is ref64.w["model.embed_tokens.weight"] and ref64.lm_head.shape == (cfg.vocab_size, cfg.hidden_size)


def test_tree_verify_equals_root_to_node_paths(cfg, ref64):
    rng = np.random.default_rng(4)
    s = 7
    prefix = rng.integers(0, cfg.vocab_size, s)
    base = ref64.new_cache()
    ref64.forward(prefix, np.arange(s), base)
    for trial in range(3):
        n = int(rng.integers(4, 11))
        parents, depths, vis = random_tree(rng, n)
        toks = rng.integers(0, cfg.vocab_size, n)
        tree_cache = base.copy()
        lg, feats = ref64.forward(toks, s + depths, tree_cache, visible=vis, capture_layers=(0, 2))
        assert tree_cache.length == s + n
        for i in range(n):
            path = path_to(parents, i)
            pc = base.copy()
            plg, pf = ref64.forward(toks[path], s + np.arange(len(path)), pc, capture_layers=(0, 2))
            assert rel(lg[i], plg[-1]) <= 1e-12, f"trial {trial}, tree row {i}"
            assert rel(feats[i], pf[-1]) <= 1e-12
            for layer in range(cfg.num_hidden_layers):   # tree row i's KV sits at cache row s + i
                assert rel(tree_cache.layer(layer)[s + i], pc.layer(layer)[-1]) <= 1e-12


def test_incremental_decode_equals_prefill(cfg, ref64):
    rng = np.random.default_rng(5)
    n0, n = 6, 13
    toks = rng.integers(0, cfg.vocab_size, n)
    full_cache = ref64.new_cache()
    full, ffeat = ref64.forward(toks, np.arange(n), full_cache, capture_layers=(0, 3))
    inc_cache = ref64.new_cache()
    parts, pfeat = [], []
    lg, f = ref64.forward(toks[:n0], np.arange(n0), inc_cache, capture_layers=(0, 3))
    parts.append(lg), pfeat.append(f)
    for t in range(n0, n):
        lg, f = ref64.forward(toks[t:t + 1], np.array([t]), inc_cache, capture_layers=(0, 3))
        parts.append(lg), pfeat.append(f)
    assert rel(np.concatenate(parts), full) <= 1e-12
    assert rel(np.concatenate(pfeat), ffeat) <= 1e-12
    for layer in range(cfg.num_hidden_layers):
        assert rel(inc_cache.layer(layer), full_cache.layer(layer)) <= 1e-12


def test_float32_close_to_float64(cfg, weights, ref64):
    ref32 = ReferenceTarget(cfg, weights, dtype=np.float32)
    rng = np.random.default_rng(6)
    toks = rng.integers(0, cfg.vocab_size, 12)
    c32, c64 = ref32.new_cache(), ref64.new_cache()
    a, fa = ref32.forward(toks, np.arange(12), c32, capture_layers=(2,))
    b, fb = ref64.forward(toks, np.arange(12), c64, capture_layers=(2,))
    assert a.dtype == np.float32 and fa.dtype == np.float32 and c32.layer(0).dtype == np.float32
    assert b.dtype == np.float64
    assert rel(a, b) <= 1e-4 and rel(fa, fb) <= 1e-4
    # and the two differ at all: float32 really computes in float32
    assert rel(a, b) > 1e-9


def test_far_positions_and_explicit_causal_mask(cfg, ref64):
    """Positions need not start at 0 or be contiguous; an explicit causal mask equals the default."""
    rng = np.random.default_rng(7)
    toks = rng.integers(0, cfg.vocab_size, 5)
    pos = np.array([100000, 100001, 100003, 100007, 200000])
    a, _ = ref64.forward(toks, pos, ref64.new_cache())
    b, _ = ref64.forward(toks, pos, ref64.new_cache(), visible=np.tril(np.ones((5, 5), bool)))
    assert rel(a, b) == 0.0
    c, _ = ref64.forward(toks, np.arange(5), ref64.new_cache())
    assert rel(a, c) > 1e-3   # positions matter


# ==================================================================================================
# latent cache

def test_cache_append_truncate_commit():
    rng = np.random.default_rng(8)
    c = LatentKVCache(3, 5, np.float64)
    rows = rng.standard_normal((3, 40, 5))
    c.append(rows[:, :25])
    c.append(rows[:, 25:])          # crosses the growth boundary
    assert c.length == 40 and np.array_equal(c.layer(2), rows[2])
    c.truncate(33)
    assert c.length == 33 and np.array_equal(c.layer(1), rows[1, :33])
    c.commit(20, [21, 27, 24, 32])  # not ascending on purpose: order is the caller's
    assert c.length == 24
    for l in range(3):
        want = np.concatenate([rows[l, :20], rows[l, [21, 27, 24, 32]]])
        assert np.array_equal(c.layer(l), want)
    c.commit(24, [])
    assert c.length == 24
    c.commit(22, [23])              # the source slot directly above the destination
    assert c.length == 23 and np.array_equal(c.layer(0)[22], rows[0, 32])
    with pytest.raises(ValueError, match="rows"):
        c.commit(10, [5])
    with pytest.raises(ValueError, match="duplicates"):
        c.commit(10, [12, 12])
    with pytest.raises(ValueError, match="rows"):
        c.commit(10, [23])
    with pytest.raises(ValueError, match="prefix_len"):
        c.commit(30, [])
    with pytest.raises(ValueError, match="truncate"):
        c.truncate(24)
    with pytest.raises(ValueError, match="rows has shape"):
        c.append(np.zeros((3, 2, 4)))
    with pytest.raises(ValueError):
        c.layer(0)[0, 0] = 1.0      # views are read-only


def test_commit_then_decode_equals_path_prefill(cfg, ref64):
    """Verify a tree, commit an accepted path, decode on: same as prefilling that path."""
    rng = np.random.default_rng(9)
    s = 5
    prefix = rng.integers(0, cfg.vocab_size, s)
    parents = np.array([-1, 0, 0, 1, 2, 4, 4])
    depths = np.array([0, 1, 1, 2, 2, 3, 3])
    vis = np.eye(7, dtype=bool)
    for i in range(1, 7):
        vis[i] |= vis[parents[i]]
    toks = rng.integers(0, cfg.vocab_size, 7)
    cache = ref64.new_cache()
    ref64.forward(prefix, np.arange(s), cache)
    ref64.forward(toks, s + depths, cache, visible=vis)
    accepted = [0, 2, 4, 6]
    cache.commit(s, [s + r for r in accepted])
    nxt = np.array([int(rng.integers(0, cfg.vocab_size))])
    lg, _ = ref64.forward(nxt, np.array([s + 4]), cache)
    full = ref64.new_cache()
    want, _ = ref64.forward(np.concatenate([prefix, toks[accepted], nxt]), np.arange(s + 5), full)
    assert rel(lg[0], want[-1]) <= 1e-12
    for layer in range(cfg.num_hidden_layers):
        assert rel(cache.layer(layer), full.layer(layer)) <= 1e-12


# ==================================================================================================
# standalone pieces

def test_rms_norm_formula_and_dtype():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((4, 7)) * 3
    w = rng.standard_normal(7)
    for i in range(4):
        want = w * x[i] / math.sqrt(sum(v * v for v in x[i]) / 7 + 1e-5)
        assert rel(rms_norm(x, w, 1e-5)[i], want) <= 1e-14
    assert rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5).dtype == np.float32
    assert rms_norm(x.astype(np.float16), w.astype(np.float16), 1e-5).dtype == np.float32
    # eps matters for small rows (catches a dropped/misplaced eps)
    small = x[:1] * 1e-3
    assert rel(rms_norm(small, w, 1e-5), rms_norm(small, w, 1e-6)) > 1e-3
    with pytest.raises(ValueError, match="weight w"):
        rms_norm(x, w[:5], 1e-5)


def test_yarn_inv_freq_kimi_ramp():
    rc = RopeConfig.from_dict(tiny_target_config().to_dict(wrapper=False), "t")
    f = yarn_inv_freq(rc, 64)
    i = np.arange(32)
    extra = 50000.0 ** (-2 * i / 64)
    # K2.6 ramp: pairs <= 8 keep the original frequency, pairs >= 20 are fully interpolated (/64)
    assert np.allclose(f[:9], extra[:9], rtol=1e-15)
    assert np.allclose(f[20:], extra[20:] / 64, rtol=1e-15)
    r = (i[9:20] - 8) / 12
    assert np.allclose(f[9:20], extra[9:20] / 64 * r + extra[9:20] * (1 - r), rtol=1e-15)
    assert np.allclose(yarn_inv_freq(RopeConfig(theta=1e4), 16), 1e4 ** (-np.arange(8) / 8), rtol=1e-15)
    with pytest.raises(ValueError, match="dim"):
        yarn_inv_freq(rc, 63)


def test_rope_pairings_against_explicit_formula():
    rng = np.random.default_rng(13)
    T, nh, D = 5, 3, 16
    x = rng.standard_normal((T, nh, D))
    pos = rng.integers(0, 5000, T)
    inv = yarn_inv_freq(RopeConfig(theta=1e4), D)
    amp = 1.3
    adj, rh = apply_rope_adjacent(x, pos, inv, amp), apply_rope_rotate_half(x, pos, inv, amp)
    want_adj, want_rh = np.empty_like(x), np.empty_like(x)
    for t in range(T):
        for h in range(nh):
            for i in range(D // 2):
                c, s = amp * math.cos(pos[t] * inv[i]), amp * math.sin(pos[t] * inv[i])
                a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                want_adj[t, h, 2 * i], want_adj[t, h, 2 * i + 1] = a * c - b * s, b * c + a * s
                a, b = x[t, h, i], x[t, h, i + D // 2]
                want_rh[t, h, i], want_rh[t, h, i + D // 2] = a * c - b * s, b * c + a * s
    assert rel(adj, want_adj) <= 1e-14 and rel(rh, want_rh) <= 1e-14
    # 2-D input (the k_pe shape) and relative-position property of the rotation
    q, k = rng.standard_normal((1, D)), rng.standard_normal((1, D))
    d1 = apply_rope_adjacent(q, np.array([70]), inv) @ apply_rope_adjacent(k, np.array([50]), inv).T
    d2 = apply_rope_adjacent(q, np.array([1020]), inv) @ apply_rope_adjacent(k, np.array([1000]), inv).T
    assert abs(d1 - d2).max() <= 1e-11
    with pytest.raises(ValueError, match="pos"):
        apply_rope_adjacent(x, pos[:4], inv)
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope_rotate_half(x, pos, inv[:7])


def _mla_inputs(rng, T=4, S=9, nh=3, dn=8, dr=6, dv=5, r=12):
    q_nope = rng.standard_normal((T, nh, dn))
    q_pe = rng.standard_normal((T, nh, dr))
    latent = rng.standard_normal((S, r + dr))
    kv_b = rng.standard_normal((nh * (dn + dv), r)) / math.sqrt(r)
    allowed = rng.random((T, S)) < 0.6
    allowed[:, 0] = True
    return q_nope, q_pe, latent, kv_b, allowed


def test_mla_absorbed_equals_naive_and_explicit_loop():
    rng = np.random.default_rng(14)
    T, S, nh, dn, dr, dv, r = 4, 9, 3, 8, 6, 5, 12
    q_nope, q_pe, latent, kv_b, allowed = _mla_inputs(rng, T, S, nh, dn, dr, dv, r)
    w_uk, w_uv = split_kv_b(kv_b, nh, dn, dv)
    # head-major split: head h's W_UK rows are h*(dn+dv) .. h*(dn+dv)+dn-1
    assert np.array_equal(w_uk[1], kv_b[(dn + dv):(dn + dv) + dn])
    assert np.array_equal(w_uv[2], kv_b[2 * (dn + dv) + dn:3 * (dn + dv)])
    sc = 0.37
    a = mla_attention_absorbed(q_nope, q_pe, latent, w_uk, w_uv, allowed, sc)
    b = mla_attention_naive(q_nope, q_pe, latent, w_uk, w_uv, allowed, sc)
    assert rel(a, b) <= 1e-10
    want = np.zeros((T, nh, dv))
    for t in range(T):
        for h in range(nh):
            ks = [np.concatenate([w_uk[h] @ latent[s, :r], latent[s, r:]]) for s in range(S)]
            vs = [w_uv[h] @ latent[s, :r] for s in range(S)]
            q = np.concatenate([q_nope[t, h], q_pe[t, h]])
            sc_ts = [q @ ks[s] * sc for s in range(S) if allowed[t, s]]
            m = max(sc_ts)
            p = [math.exp(v - m) for v in sc_ts]
            vv = [vs[s] for s in range(S) if allowed[t, s]]
            want[t, h] = sum(pi * vi for pi, vi in zip(p, vv)) / sum(p)
    assert rel(a, want) <= 1e-12
    o_lat = latent_attention(np.einsum("thd,hdr->thr", q_nope, w_uk), q_pe, latent, allowed, sc)
    assert o_lat.shape == (T, nh, r) and rel(np.einsum("thr,hvr->thv", o_lat, w_uv), want) <= 1e-12
    allowed[1] = False
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        mla_attention_absorbed(q_nope, q_pe, latent, w_uk, w_uv, allowed, sc)
    with pytest.raises(ValueError, match="latent"):
        mla_attention_naive(q_nope, q_pe, latent[:, :-1], w_uk, w_uv, allowed, sc)


def _brute_force_route(x, gate_w, bias, E, k, G, TG, scale):
    ids_all, w_all = [], []
    per = E // G
    for t in range(x.shape[0]):
        s = [1.0 / (1.0 + math.exp(-float(x[t] @ gate_w[e]))) for e in range(E)]
        c = [s[e] + bias[e] for e in range(E)]
        gscore = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
        best_groups = max(itertools.combinations(range(G), TG), key=lambda gs: sum(gscore[g] for g in gs))
        cand = [e for g in best_groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(cand, key=lambda e: -c[e])[:k]
        tot = sum(s[e] for e in chosen)
        ids_all.append(chosen)
        w_all.append([s[e] / tot * scale for e in chosen])
    return np.array(ids_all), np.array(w_all)


def test_route_group_limited_against_brute_force():
    cfg = tiny_target_config(n_group=4, topk_group=2, num_experts_per_tok=6)
    rng = np.random.default_rng(15)
    T, E, H = 40, cfg.n_routed_experts, cfg.hidden_size
    x = rng.standard_normal((T, H))
    gate_w = rng.standard_normal((E, H)) / math.sqrt(H)
    bias = 0.05 * rng.standard_normal(E)
    ids, w = route(x, gate_w, bias, cfg)
    bids, bw = _brute_force_route(x, gate_w, bias, E, 6, 4, 2, cfg.routed_scaling_factor)
    assert ids.shape == (T, 6) and np.array_equal(ids, bids)
    assert rel(w, bw) <= 1e-13
    # group limiting matters for these inputs: the unrestricted top-6 differs for some tokens
    free_ids, _ = route(x, gate_w, bias, tiny_target_config(num_experts_per_tok=6))
    assert not np.array_equal(np.sort(free_ids, 1), np.sort(ids, 1))
    # and every chosen expert of a token comes from at most topk_group groups
    assert max(len(set((ids[t] // 8).tolist())) for t in range(T)) <= 2


@pytest.mark.oracle
def test_route_group_limited_against_hf_router():
    """HF's DeepseekV3TopkRouter, run in float64 (hf_oracle._Float64Torch), as a second oracle for routing."""
    import torch
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as mod
    from hf_oracle import _Float64Torch, hf_config
    cfg = tiny_target_config(n_group=4, topk_group=2, num_experts_per_tok=6)
    rng = np.random.default_rng(19)
    T, E, H = 40, cfg.n_routed_experts, cfg.hidden_size
    x = rng.standard_normal((T, H))
    gate_w = rng.standard_normal((E, H)) / math.sqrt(H)
    bias = 0.05 * rng.standard_normal(E)
    router = mod.DeepseekV3TopkRouter(hf_config(cfg))
    router.weight.data = torch.from_numpy(gate_w)
    router.e_score_correction_bias.data = torch.from_numpy(bias)
    saved, mod.torch = mod.torch, _Float64Torch(torch)
    try:
        with torch.no_grad():
            _, hw, hids = router(torch.from_numpy(x))
    finally:
        mod.torch = saved
    ids, w = route(x, gate_w, bias, cfg)
    # HF returns the top-k unsorted: compare as (id -> weight) maps per token
    order = np.argsort(hids.numpy(), axis=1)
    hids_s, hw_s = np.take_along_axis(hids.numpy(), order, 1), np.take_along_axis(hw.numpy(), order, 1)
    o2 = np.argsort(ids, axis=1)
    assert np.array_equal(np.take_along_axis(ids, o2, 1), hids_s)
    assert rel(np.take_along_axis(w, o2, 1), hw_s) <= 1e-13


def test_route_bias_chooses_but_weights_are_unbiased():
    cfg = tiny_target_config()
    rng = np.random.default_rng(16)
    T, E, H = 6, cfg.n_routed_experts, cfg.hidden_size
    x = rng.standard_normal((T, H))
    gate_w = rng.standard_normal((E, H)) / math.sqrt(H)
    s = 1.0 / (1.0 + np.exp(-(x @ gate_w.T)))
    worst = np.argmin(s.sum(0))
    bias = np.zeros(E)
    bias[worst] = 5.0                    # pulls the weakest expert into every token's top-k
    ids, w = route(x, gate_w, bias, cfg)
    ids0, _ = route(x, gate_w, np.zeros(E), cfg)
    assert (ids[:, 0] == worst).all() and not (ids0 == worst).any()
    want = np.take_along_axis(s, ids, 1)
    want = want / want.sum(1, keepdims=True) * cfg.routed_scaling_factor
    assert rel(w, want) <= 1e-14
    assert np.allclose(w.sum(1), cfg.routed_scaling_factor, rtol=1e-14)
    # ties go to the lower expert id
    ids_t, _ = route(np.zeros((1, H)), gate_w, np.zeros(E), cfg)
    assert ids_t[0].tolist() == list(range(cfg.num_experts_per_tok))
    with pytest.raises(ValueError, match="bias"):
        route(x, gate_w, bias[:-1], cfg)


def test_moe_experts_against_loop():
    rng = np.random.default_rng(17)
    T, H, I, E, k = 7, 12, 10, 6, 3
    x = rng.standard_normal((T, H))
    g, u = rng.standard_normal((E, I, H)) / 3, rng.standard_normal((E, I, H)) / 3
    d = rng.standard_normal((E, H, I)) / 3
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    w = rng.random((T, k))
    y = moe_experts(x, ids, w, g, u, d)
    want = np.zeros((T, H))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            a = g[e] @ x[t]
            want[t] += w[t, j] * (d[e] @ (a / (1 + np.exp(-a)) * (u[e] @ x[t])))
    assert rel(y, want) <= 1e-14
    assert rel(moe_experts(x, ids, w, list(g), list(u), list(d)), want) <= 1e-14
    a0 = g[0] @ x[0]
    assert rel(swiglu_mlp(x[:1], g[0], u[0], d[0])[0], d[0] @ (a0 / (1 + np.exp(-a0)) * (u[0] @ x[0]))) <= 1e-14
    with pytest.raises(ValueError, match="ids"):
        moe_experts(x, ids + E, w, g, u, d)


# ==================================================================================================
# input validation

def test_weight_validation_names_the_tensor(cfg, weights):
    bad = dict(weights)
    del bad["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        ReferenceTarget(cfg, bad)
    bad = dict(weights)
    bad["model.layers.1.self_attn.kv_b_proj.weight"] = bad["model.layers.1.self_attn.kv_b_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight.*shape"):
        ReferenceTarget(cfg, bad)
    bad = {"language_model." + k: v for k, v in weights.items()}
    with pytest.raises(ValueError, match="prefix"):
        ReferenceTarget(cfg, bad)
    bad = dict(weights)
    bad["model.norm.weight"] = np.zeros(cfg.hidden_size, np.uint16)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*dtype"):
        ReferenceTarget(cfg, bad)
    bad["model.norm.weight"] = np.full(cfg.hidden_size, np.nan)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*non-finite"):
        ReferenceTarget(cfg, bad)
    with pytest.raises(ValueError, match="dtype"):
        ReferenceTarget(cfg, weights, dtype=np.float16)
    with pytest.raises(ValueError, match="attention"):
        ReferenceTarget(cfg, weights, attention="flash")


def test_forward_validation(cfg, ref64):
    c = ref64.new_cache()
    with pytest.raises(ValueError, match="tokens"):
        ref64.forward(np.array([cfg.vocab_size]), np.array([0]), c)
    with pytest.raises(ValueError, match="positions"):
        ref64.forward(np.array([1, 2]), np.array([0]), c)
    with pytest.raises(ValueError, match="visible"):
        ref64.forward(np.array([1, 2]), np.array([0, 1]), c, visible=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="see nothing"):
        ref64.forward(np.array([1, 2]), np.array([0, 1]), c, visible=np.array([[True, False], [False, False]]))
    with pytest.raises(ValueError, match="capture_layers"):
        ref64.forward(np.array([1]), np.array([0]), c, capture_layers=(cfg.num_hidden_layers,))
    with pytest.raises(ValueError, match="cache"):
        ref64.forward(np.array([1]), np.array([0]), LatentKVCache(cfg.num_hidden_layers, 576, np.float32))
    assert c.length == 0    # failed calls leave the cache untouched


# ==================================================================================================
# the tiny checkpoint (real K2.6 file format, INT4 experts): our loader + reference vs third-party loader + HF

@pytest.mark.oracle
def test_oracle_tiny_checkpoint():
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
    from hf_oracle import hf_weights_from_checkpoint

    target_dir, _ = ensure_tiny_checkpoints()
    cfg = TargetConfig.load(target_dir)
    assert cfg.weight_prefix == "language_model." and cfg.quant is not None
    ref = ReferenceTarget(cfg, load_reference_weights(target_dir, dtype=np.float64))
    model = build_hf_model(cfg, hf_weights_from_checkpoint(target_dir))
    rng = np.random.default_rng(18)
    s, steps = 16, 3
    toks = rng.integers(0, cfg.vocab_size, s + steps)
    parents, depths, vis = random_tree(rng, 9)
    tree_toks = rng.integers(0, cfg.vocab_size, 9)
    for mode, tol in HF_MODES:
        with _hf_mode(mode, model, cfg) as m:
            cache = ref.new_cache()
            lg, _ = ref.forward(toks[:s], np.arange(s), cache)
            hl, _, hc = hf_forward(m, toks[:s], np.arange(s))
            assert rel(lg, hl) <= tol, mode
            for t in range(s, s + steps):
                lg, _ = ref.forward(toks[t:t + 1], np.array([t]), cache)
                hl, _, hc = hf_forward(m, toks[t:t + 1], np.array([t]), cache=hc, past_len=t)
                assert rel(lg, hl) <= tol, (mode, t)
            n = s + steps
            lg, _ = ref.forward(tree_toks, n + depths, cache, visible=vis)
            hl, _, hc = hf_forward(m, tree_toks, n + depths, cache=hc, visible=vis, past_len=n)
            assert rel(lg, hl) <= tol, mode
            for layer in range(cfg.num_hidden_layers):
                assert rel(cache.layer(layer), hf_cache_rows(hc, layer)) <= tol
