"""DFlash reference drafter against an independent, loop-by-loop float64 re-computation."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ddtree_cupy.config import DrafterConfig
from ddtree_cupy.reference.drafter import ReferenceDrafter, drafter_weight_shapes, rope_inv_freq


def make_cfg(**over):
    d = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 61, "rms_norm_eps": 1e-6, "block_size": 5,
         "rope_theta": 5e4, "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 64,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
         "dflash_config": {"target_layer_ids": [0, 2, 3], "mask_token_id": 59}}
    d.update(over)
    return DrafterConfig.from_dict(d, "test-drafter")


def make_weights(cfg, seed):
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in drafter_weight_shapes(cfg).items():
        if len(shape) == 1:   # norms: around 1 so that a swapped norm shows up
            w[name] = 1.0 + 0.3 * rng.standard_normal(shape)
        else:
            w[name] = rng.standard_normal(shape) / math.sqrt(shape[1])
    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size))
    lm = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)) / math.sqrt(cfg.hidden_size)
    return w, embed, lm


# ---------------- independent re-computation: explicit loops, complex-number RoPE, float64 -----------------

def _norm(x, w, eps):
    return [w[i] * x[i] / math.sqrt(sum(v * v for v in x) / len(x) + eps) for i in range(len(x))]


def _norm_np(x, w, eps):
    return np.array(_norm(list(x), list(w), eps))


def _inv_freq_direct(cfg):
    # YaRN written out per frequency index, straight from the formula in the design notes (dim = head_dim).
    r, d = cfg.rope, cfg.head_dim
    out = []
    for i in range(d // 2):
        extra = r.theta ** (-(2 * i) / d)
        if r.kind != "yarn":
            out.append(extra)
            continue
        c = lambda n: d * math.log(r.original_max_position_embeddings / (n * 2 * math.pi)) / (2 * math.log(r.theta))
        lo, hi = max(math.floor(c(r.beta_fast)), 0), min(math.ceil(c(r.beta_slow)), d - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(extra / r.factor * ramp + extra * (1 - ramp))
    return np.array(out)


def _rope_complex(x, pos, inv, amp):
    # rotate-half pairs (i, i + d/2) as one complex number, turned by amp * e^{i pos f}
    h = len(x) // 2
    z = (x[:h] + 1j * x[h:]) * amp * np.exp(1j * pos * inv)
    return np.concatenate([z.real, z.imag])


def naive_draft(cfg, w, embed, lm, feats, ctx_pos, bonus, s, amp, window=None):
    H, nh, kvh, hd, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    inv = _inv_freq_direct(cfg)
    if window is not None:
        feats, ctx_pos = feats[-window:], ctx_pos[-window:]
    ctx = [_norm_np(w["fc.weight"] @ f.reshape(-1), w["hidden_norm.weight"], eps) for f in feats]
    ids = [bonus] + [cfg.mask_token_id] * (cfg.block_size - 1)
    pos = [s + j for j in range(cfg.block_size)]
    h = [embed[t].copy() for t in ids]
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        W = lambda n: w[p + n]

        def kv(x, ps):
            k = (W("self_attn.k_proj.weight") @ x).reshape(kvh, hd)
            v = (W("self_attn.v_proj.weight") @ x).reshape(kvh, hd)
            k = np.stack([_rope_complex(_norm_np(k[j], W("self_attn.k_norm.weight"), eps), ps, inv, amp) for j in range(kvh)])
            return k, v

        keys, vals = [], []
        for x, ps in zip(ctx, ctx_pos):
            k, v = kv(x, ps)
            keys.append(k), vals.append(v)
        xs = [_norm_np(hh, W("input_layernorm.weight"), eps) for hh in h]
        for x, ps in zip(xs, pos):
            k, v = kv(x, ps)
            keys.append(k), vals.append(v)
        new_h = []
        for r, (x, ps) in enumerate(zip(xs, pos)):
            q = (W("self_attn.q_proj.weight") @ x).reshape(nh, hd)
            o = np.zeros((nh, hd))
            for head in range(nh):
                qh = _rope_complex(_norm_np(q[head], W("self_attn.q_norm.weight"), eps), ps, inv, amp)
                kvhead = head // (nh // kvh)
                sc = [float(qh @ k[kvhead]) / math.sqrt(hd) for k in keys]
                m = max(sc)
                e = [math.exp(v - m) for v in sc]
                z = sum(e)
                for pr, v in zip(e, vals):
                    o[head] += pr / z * v[kvhead]
            y = h[r] + W("self_attn.o_proj.weight") @ o.reshape(-1)
            xm = _norm_np(y, W("post_attention_layernorm.weight"), eps)
            g = W("mlp.gate_proj.weight") @ xm
            u = W("mlp.up_proj.weight") @ xm
            new_h.append(y + W("mlp.down_proj.weight") @ (g / (1 + np.exp(-g)) * u))
        h = new_h
    return np.stack([lm @ _norm_np(hh, w["norm.weight"], eps) for hh in h[1:]])


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _setup(seed, n_ctx, cfg=None, dtype=np.float64):
    cfg = cfg or make_cfg()
    w, embed, lm = make_weights(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    feats = rng.standard_normal((n_ctx, cfg.num_context_features, cfg.hidden_size)) * 2.0
    d = ReferenceDrafter(cfg, w, embed, lm, dtype=dtype)
    cache = d.new_cache()
    # append in uneven chunks, as a decode loop does (prefill, then accepted runs)
    cuts = [0, n_ctx // 2, n_ctx // 2 + 1, n_ctx]
    for a, b in zip(cuts[:-1], cuts[1:]):
        d.append_context(cache, feats[a:b], np.arange(a, b))
    return cfg, w, embed, lm, feats, d, cache


@pytest.mark.parametrize("seed,n_ctx", [(0, 7), (1, 12)])
def test_draft_matches_independent_loops(seed, n_ctx):
    cfg, w, embed, lm, feats, d, cache = _setup(seed, n_ctx)
    bonus = 17
    got = d.draft(cache, bonus, n_ctx)
    ref = naive_draft(cfg, w, embed, lm, feats, np.arange(n_ctx), bonus, n_ctx, cfg.effective_rope_amplitude)
    assert got.shape == (cfg.block_size - 1, cfg.vocab_size)
    assert rel(got, ref) < 1e-12
    # the draft leaves the cache alone (block K/V discarded): drafting again gives the same logits
    assert cache.length == n_ctx
    np.testing.assert_array_equal(d.draft(cache, bonus, n_ctx), got)
    # float32 tracks the float64 reference
    d32 = ReferenceDrafter(cfg, w, embed, lm, dtype=np.float32)
    c32 = d32.new_cache()
    d32.append_context(c32, feats, np.arange(n_ctx))
    assert rel(d32.draft(c32, bonus, n_ctx).astype(np.float64), ref) < 2e-5


def test_positions_and_bonus_matter():
    cfg, w, embed, lm, feats, d, cache = _setup(2, 9)
    base = d.draft(cache, 3, 9)
    assert rel(d.draft(cache, 4, 9), base) > 1e-3        # the bonus row feeds every block row
    assert rel(d.draft(cache, 3, 10), base) > 1e-6       # block positions are absolute (RoPE)
    # a gap between context and block is exactly what the independent version computes too
    ref = naive_draft(cfg, w, embed, lm, feats, np.arange(9), 3, 10, cfg.effective_rope_amplitude)
    assert rel(d.draft(cache, 3, 10), ref) < 1e-12


def test_draft_window():
    cfg = make_cfg()
    n, W = 11, 4
    _, w, embed, lm, feats, d_full, c_full = _setup(3, n, cfg)
    dw = ReferenceDrafter(cfg.with_options(draft_window=W), w, embed, lm, dtype=np.float64)
    cw = dw.new_cache()
    dw.append_context(cw, feats, np.arange(n))
    got = dw.draft(cw, 5, n)
    ref = naive_draft(cfg, w, embed, lm, feats, np.arange(n), 5, n, cfg.effective_rope_amplitude, window=W)
    assert rel(got, ref) < 1e-12
    assert rel(got, d_full.draft(c_full, 5, n)) > 1e-4   # the window changed what the block sees
    # a window at least as long as the context is the full context
    dbig = ReferenceDrafter(cfg.with_options(draft_window=n), w, embed, lm, dtype=np.float64)
    cb = dbig.new_cache()
    dbig.append_context(cb, feats, np.arange(n))
    np.testing.assert_allclose(dbig.draft(cb, 5, n), d_full.draft(c_full, 5, n), rtol=0, atol=1e-12)


def test_rope_amplitude_option():
    cfg = make_cfg()
    assert cfg.effective_rope_amplitude == 1.0
    amp = 1 + 0.1 * math.log(64)
    _, w, embed, lm, feats, d1, c1 = _setup(4, 8, cfg)
    da = ReferenceDrafter(cfg.with_options(rope_amplitude=amp), w, embed, lm, dtype=np.float64)
    ca = da.new_cache()
    da.append_context(ca, feats, np.arange(8))
    got = da.draft(ca, 9, 8)
    assert rel(got, d1.draft(c1, 9, 8)) > 1e-3
    assert rel(got, naive_draft(cfg, w, embed, lm, feats, np.arange(8), 9, 8, amp)) < 1e-12


def test_rope_inv_freq_plain_and_yarn():
    yarn = make_cfg()
    plain = make_cfg(rope_scaling=None)
    for c in (yarn, plain):
        np.testing.assert_allclose(rope_inv_freq(c.rope, c.head_dim), _inv_freq_direct(c), rtol=1e-15)
    assert not np.allclose(rope_inv_freq(yarn.rope, 16), rope_inv_freq(plain.rope, 16))


@pytest.mark.oracle
def test_rope_inv_freq_against_transformers():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = make_cfg(head_dim=128, num_attention_heads=2, num_key_value_heads=1, hidden_size=64,
                   rope_scaling={"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    hf = Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                     max_position_embeddings=262144,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 64.0,
                                      "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0})
    inv, att = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    np.testing.assert_allclose(rope_inv_freq(cfg.rope, 128), inv.double().numpy(), rtol=1e-6)
    assert abs(att - cfg.effective_rope_amplitude) < 1e-12


def test_bad_inputs():
    cfg = make_cfg()
    w, embed, lm = make_weights(cfg, 0)
    bad = dict(w)
    del bad["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        ReferenceDrafter(cfg, bad, embed, lm)
    bad = dict(w, **{"fc.weight": w["fc.weight"][:, :-1]})
    with pytest.raises(ValueError, match="fc.weight"):
        ReferenceDrafter(cfg, bad, embed, lm)
    with pytest.raises(ValueError, match="lm_head"):
        ReferenceDrafter(cfg, w, embed, lm[:-1])
    # a "model." prefix on the stack's tensors is accepted
    d = ReferenceDrafter(cfg, {"model." + k: v for k, v in w.items()}, embed, lm)
    c = d.new_cache()
    with pytest.raises(ValueError, match="feats must be"):
        d.append_context(c, np.ones((2, 2, cfg.hidden_size)), [0, 1])
    d.append_context(c, np.ones((2, 3, cfg.hidden_size)), [0, 1])
    with pytest.raises(ValueError, match="positions must increase"):
        d.append_context(c, np.ones((1, 3, cfg.hidden_size)), [1])
    with pytest.raises(ValueError, match="bonus token"):
        d.draft(c, cfg.vocab_size, 2)


def _hf_block(cfg, w, embed, s, bonus, rope_params):
    """HF transformers' Qwen3Model over the block alone with a non-causal mask: what the DFlash draft
    computes when the context is empty (same layers, norms, RoPE, GQA, SwiGLU)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model
    hf = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                     rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=4096, rope_parameters=rope_params,
                     attn_implementation="eager")
    m = Qwen3Model(hf).double().eval()
    sd = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in w.items() if k.startswith("layers.") or k == "norm.weight"}
    sd["embed_tokens.weight"] = torch.from_numpy(np.asarray(embed, np.float64))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    B = cfg.block_size
    ids = torch.tensor([[bonus] + [cfg.mask_token_id] * (B - 1)])
    with torch.no_grad():
        out = m(input_ids=ids, position_ids=torch.arange(s, s + B)[None],
                attention_mask=torch.zeros(1, 1, B, B, dtype=torch.float64))   # additive: all visible
    return out.last_hidden_state[0].numpy()


@pytest.mark.oracle
def test_block_against_transformers_qwen3():
    cfg = make_cfg()
    w, embed, lm = make_weights(cfg, 5)
    r = cfg.rope
    yarn = {"rope_type": "yarn", "rope_theta": r.theta, "factor": r.factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
    s, bonus = 9, 23
    # HF computes RMSNorm and inv_freq in float32 even for a float64 model: agreement ~1e-7, not 1e-15
    ref = _hf_block(cfg, w, embed, s, bonus, dict(yarn, mscale=1.0, mscale_all_dim=1.0))
    d = ReferenceDrafter(cfg, w, embed, lm, dtype=np.float64)
    got = d.draft_hidden(d.new_cache(), bonus, s)
    assert rel(got, ref) < 1e-5
    # HF without mscale fields uses attention factor 1 + 0.1 ln(factor): our rope_amplitude option reproduces it
    ref_amp = _hf_block(cfg, w, embed, s, bonus, yarn)
    assert rel(ref_amp, ref) > 1e-3
    da = ReferenceDrafter(cfg.with_options(rope_amplitude=1 + 0.1 * math.log(r.factor)), w, embed, lm, dtype=np.float64)
    assert rel(da.draft_hidden(da.new_cache(), bonus, s), ref_amp) < 1e-5
