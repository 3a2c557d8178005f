"""Tiny real-format checkpoints: determinism, format, configs, tokenizer, and realistic activations."""
from __future__ import annotations

import base64
import json
import math
import os
import re

import numpy as np
import pytest

from _specs import MICRO

from ddtree_cupy.bf16 import bf16_bits_to_f32
from ddtree_cupy.checkpoint import (INDEX_FILE, Checkpoint, expected_drafter_tensors, expected_target_tensors,
                                    load_reference_weights, read_safetensors_header)
from ddtree_cupy.config import DrafterConfig, TargetConfig
from ddtree_cupy.int4 import unpack_int4
from ddtree_cupy.tinymodel import (SPECIAL_OFFSETS, TinySpec, bpe_ranks, ensure_tiny_checkpoints, main,
                                   target_tensors, write_tiny_drafter, write_tiny_target)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("tinycache")), seed=0)


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_deterministic_bytes(tmp_path):
    a = _files(write_tiny_target(str(tmp_path / "a"), 5, MICRO))
    b = _files(write_tiny_target(str(tmp_path / "b"), 5, MICRO))
    c = _files(write_tiny_target(str(tmp_path / "c"), 6, MICRO))
    assert a == b
    assert set(a) == set(c)
    shards = [f for f in a if f.endswith(".safetensors")]
    assert len(shards) == 3 and all(a[f] != c[f] for f in shards)
    assert a["tiktoken.model"] == c["tiktoken.model"]            # the tokenizer does not depend on the seed
    da = _files(write_tiny_drafter(str(tmp_path / "da"), 5, MICRO))
    db = _files(write_tiny_drafter(str(tmp_path / "db"), 5, MICRO))
    dc = _files(write_tiny_drafter(str(tmp_path / "dc"), 6, MICRO))
    assert da == db and da["model.safetensors"] != dc["model.safetensors"]


def test_ensure_reuses_cache(tmp_path):
    t1, d1 = ensure_tiny_checkpoints(str(tmp_path), seed=2, spec=MICRO)
    stamp = os.stat(os.path.join(t1, INDEX_FILE)).st_mtime_ns
    t2, d2 = ensure_tiny_checkpoints(str(tmp_path), seed=2, spec=MICRO)
    assert (t1, d1) == (t2, d2) and os.stat(os.path.join(t2, INDEX_FILE)).st_mtime_ns == stamp
    t3, _ = ensure_tiny_checkpoints(str(tmp_path), seed=3, spec=MICRO)
    assert t3 != t1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tiny-")]     # no temporaries left


def test_target_format(tiny):
    target_dir, _ = tiny
    spec = TinySpec()
    files = sorted(os.listdir(target_dir))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == spec.num_shards
    assert all(re.fullmatch(rf"model-{i + 1:05d}-of-{len(shards):05d}\.safetensors", f) for i, f in enumerate(shards))
    assert {"config.json", INDEX_FILE, "tiktoken.model", "tokenizer_config.json"} <= set(files)
    idx = json.load(open(os.path.join(target_dir, INDEX_FILE)))
    stored = {}
    for f in shards:
        infos, meta = read_safetensors_header(os.path.join(target_dir, f))
        assert meta == {"format": "pt"}
        for name, info in infos.items():
            assert idx["weight_map"][name] == f
            stored[name] = info
    assert set(idx["weight_map"]) == set(stored)
    assert idx["metadata"]["total_size"] == sum(i.nbytes for i in stored.values())
    cfg = TargetConfig.load(target_dir)
    exp = {"language_model." + k: v for k, v in expected_target_tensors(cfg).items()}
    vision = {n for n in stored if n.startswith(("vision_tower.", "mm_projector."))}
    assert len(vision) >= 2 and set(stored) - vision == set(exp)
    # the first and the last shard both hold a tensor to skip
    assert idx["weight_map"][min(vision, key=lambda n: shards.index(idx["weight_map"][n]))] == shards[0]
    assert shards[-1] in {idx["weight_map"][n] for n in vision}
    for name, (shape, dtypes) in exp.items():
        assert stored[name].shape == shape, name
        want = {"weight_shape": "I32", "weight_packed": "I32", "e_score_correction_bias": "F32"}
        assert stored[name].dtype == want.get(name.rsplit(".", 1)[-1], "BF16"), name
    # weight_shape values, for every expert of every MoE layer
    ck = Checkpoint(target_dir)
    for i in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            for proj, nk in (("gate_proj", (256, 512)), ("up_proj", (256, 512)), ("down_proj", (512, 256))):
                ws = ck.get(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight_shape", "I32")
                assert tuple(ws.tolist()) == nk
    assert cfg.moe_layers == (1, 2, 3) and cfg.n_routed_experts == 32


def test_int4_experts_are_our_quantizer_output(tiny):
    """The files hold exactly the generator's INT4 tensors, and they carry quantize_groupwise's signature:
    every group's largest |q| is 7 or 8 (scale = max|w| / 7.5), and the codes span -8..7."""
    target_dir, _ = tiny
    ck = Checkpoint(target_dir)
    packed, scale, shape = ck.get_int4("model.layers.3.mlp.experts.31.up_proj")
    q = unpack_int4(packed, scale, shape)
    assert q.min() == -8 and q.max() == 7
    gmax = np.abs(q.astype(np.int32)).reshape(shape[0], -1, 32).max(axis=2)
    assert set(np.unique(gmax).tolist()) <= {7, 8}
    raw = target_tensors(0, TinySpec())
    np.testing.assert_array_equal(raw["model.layers.3.mlp.experts.31.up_proj.weight_packed"], packed)
    np.testing.assert_array_equal(raw["model.layers.3.mlp.experts.31.up_proj.weight_scale"][1], scale)


def test_configs_parse_back(tiny):
    target_dir, drafter_dir = tiny
    spec = TinySpec()
    cfg = TargetConfig.load(target_dir)
    raw = json.load(open(os.path.join(target_dir, "config.json")))
    assert raw["model_type"] == "kimi_k25" and "text_config" in raw and "quantization_config" in raw
    assert cfg.weight_prefix == "language_model."
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (1024, 512, 4, 8)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (256, 512, 128, 64, 128)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.n_shared_experts, cfg.first_k_dense_replace) == (1024, 256, 32, 8, 1, 1)
    assert cfg.routed_scaling_factor == 2.827 and cfg.rms_norm_eps == 1e-5
    r = cfg.rope
    assert (r.kind, r.theta, r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow, r.mscale,
            r.mscale_all_dim) == ("yarn", 50000.0, 64.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert abs(cfg.softmax_scale - 0.14467963) < 1e-7
    assert cfg.quant is not None and cfg.quant.group_size == 32
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (768, 770, 1023)
    for tp in (1, 2, 4, 8):
        cfg.validate_tp(tp)
    d = DrafterConfig.load(drafter_dir)
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
            d.intermediate_size, d.block_size) == (512, 2, 16, 8, 128, 1024, 8)
    assert d.target_layer_ids == (1, 2, 3) and d.mask_token_id == 1022 and d.num_target_layers == 4
    assert d.rms_norm_eps == 1e-6 and d.rope == cfg.rope
    d.check_matches(cfg)
    for tp in (1, 2, 4, 8):
        d.validate_tp(tp)
    assert sorted(Checkpoint(drafter_dir).names()) == sorted(expected_drafter_tensors(d))
    assert spec.special_id("[UNK]") == 1022


def test_plain_variant_cli(tmp_path, capsys):
    assert main([str(tmp_path), "--seed", "1", "--plain"]) == 0
    assert "target:" in capsys.readouterr().out
    t, d = str(tmp_path / "target"), str(tmp_path / "drafter")
    raw = json.load(open(os.path.join(t, "config.json")))
    assert "text_config" not in raw and raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" in raw
    cfg = TargetConfig.load(t)
    assert cfg.weight_prefix == "" and cfg.quant is not None
    idx = json.load(open(os.path.join(t, INDEX_FILE)))
    assert set(idx["weight_map"]) == set(expected_target_tensors(cfg))          # unprefixed, no vision tensors
    assert os.path.exists(os.path.join(d, "model.safetensors"))
    # the plain and the wrapper variant hold the same weights for the same seed
    wrap = write_tiny_target(str(tmp_path / "wrap"), 1)
    a, b = Checkpoint(t), Checkpoint(wrap)
    for name in ("model.layers.2.mlp.experts.0.down_proj.weight_packed", "lm_head.weight"):
        np.testing.assert_array_equal(a.get(name), b.get(name))


# ---- tokenizer ---------------------------------------------------------------------------------------

def test_tokenizer_files(tiny):
    target_dir, _ = tiny
    lines = open(os.path.join(target_dir, "tiktoken.model")).read().splitlines()
    assert len(lines) == 768
    toks = []
    for r, line in enumerate(lines):
        b64, rank = line.split(" ")
        assert int(rank) == r
        toks.append(base64.b64decode(b64))
    assert toks[:256] == [bytes([i]) for i in range(256)]
    assert len(set(toks)) == 768
    assert b" the" in toks and b" and" in toks           # a real BPE over English text
    # every merged token splits into two earlier tokens (a BPE merge history exists)
    index = {t: i for i, t in enumerate(toks)}
    for r in range(256, 768):
        t = toks[r]
        assert any(index.get(t[:k], 1 << 30) < r and index.get(t[k:], 1 << 30) < r for k in range(1, len(t))), t
    cfg = json.load(open(os.path.join(target_dir, "tokenizer_config.json")))
    dec = cfg["added_tokens_decoder"]
    assert sorted(int(k) for k in dec) == list(range(768, 1024))
    for off, name in SPECIAL_OFFSETS.items():
        assert dec[str(768 + off)]["content"] == name and dec[str(768 + off)]["special"] is True
    assert dec["773"]["content"] == "<|reserved_token_773|>"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert bpe_ranks(768) == tuple(toks)


def test_tokenizer_loads_with_tiktoken(tiny):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    target_dir, _ = tiny
    ranks = load_tiktoken_bpe(os.path.join(target_dir, "tiktoken.model"))
    specials = {v["content"]: int(k) for k, v in
                json.load(open(os.path.join(target_dir, "tokenizer_config.json")))["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("tiny", pat_str=r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+""",
                            mergeable_ranks=ranks, special_tokens=specials)
    text = "The baker wrote in his notebook: 1987, cold and grey. Übermäßig!"
    ids = enc.encode(text)
    assert enc.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2                  # merges compress English
    assert enc.encode("<|im_end|>", allowed_special="all") == [770]


def test_tokenizer_loads_with_project_tokenizer(tiny):
    from ddtree_cupy.tokenizer import load_tokenizer

    target_dir, _ = tiny
    tok = load_tokenizer(target_dir)
    text = "When evening came, the lamps were lit along the harbour."
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_id("[UNK]") == 1022 and tok.token_id("<|im_end|>") == 770


# ---- activations -------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def _rope(x, pos, r, dim):
    """Adjacent-pair YaRN RoPE (KIMI_K2_MODEL.md), written out independently of the package's reference."""
    i = np.arange(dim // 2)
    extra = r.theta ** (-2 * i / dim)
    corr = lambda b: dim * math.log(r.original_max_position_embeddings / (b * 2 * math.pi)) / (2 * math.log(r.theta))
    lo, hi = max(math.floor(corr(r.beta_fast)), 0), min(math.ceil(corr(r.beta_slow)), dim - 1)
    ramp = np.clip((i - lo) / (hi - lo if hi != lo else 0.001), 0, 1)
    f = extra / r.factor * ramp + extra * (1 - ramp)
    ang = pos[:, None] * f[None]
    c, s = np.cos(ang), np.sin(ang)
    if x.ndim == 3:
        c, s = c[:, None], s[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def test_activations_realistic(tiny):
    """A plain float64 forward (naive MLA, causal) over 48 tokens: hidden RMS O(1) after every layer,
    attention neither uniform nor one-hot, logits with std of a few units, varied argmaxes, and the router
    bias changes some expert choices."""
    target_dir, _ = tiny
    cfg = TargetConfig.load(target_dir)
    w = load_reference_weights(target_dir, np.float64)
    rng = np.random.default_rng(11)
    T = 48
    toks = rng.integers(0, 768, T)
    pos = np.arange(T, dtype=np.float64)
    nh, dn, dr, dv, r = 8, 128, 64, 128, 512
    h = w["model.embed_tokens.weight"][toks]
    causal = np.tril(np.ones((T, T), bool))
    rms_after, max_attn, bias_changed = [], [], 0
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        a = p + "self_attn."
        q = (_rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6)
             @ w[a + "q_b_proj.weight"].T).reshape(T, nh, dn + dr)
        kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
        ckv = _rms(kv[:, :r], w[a + "kv_a_layernorm.weight"], 1e-6)
        kpe = _rope(kv[:, r:], pos, cfg.rope, dr)
        qpe = _rope(q[:, :, dn:], pos, cfg.rope, dr)
        kvb = (ckv @ w[a + "kv_b_proj.weight"].T).reshape(T, nh, dn + dv)
        s = (np.einsum("thd,shd->hts", q[:, :, :dn], kvb[:, :, :dn]) + np.einsum("thd,sd->hts", qpe, kpe))
        s = np.where(causal, s * cfg.softmax_scale, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        max_attn.append(pr[:, 16:].max(-1).mean())            # rows with >= 17 keys
        o = np.einsum("hts,shd->thd", pr, kvb[:, :, dn:]).reshape(T, nh * dv)
        h = h + o @ w[a + "o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        m = p + "mlp."
        swiglu = lambda x, g, u, d: (lambda a: a / (1 + np.exp(-a)))(x @ g.T) * (x @ u.T) @ d.T
        if not cfg.is_moe_layer(i):
            h = h + swiglu(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        else:
            sc = 1 / (1 + np.exp(-(x @ w[m + "gate.weight"].T)))
            choice = np.argsort(-(sc + w[m + "gate.e_score_correction_bias"]), axis=1, kind="stable")[:, :8]
            unbiased = np.argsort(-sc, axis=1, kind="stable")[:, :8]
            bias_changed += sum(set(a) != set(b) for a, b in zip(choice, unbiased))
            y = swiglu(x, w[m + "shared_experts.gate_proj.weight"], w[m + "shared_experts.up_proj.weight"],
                       w[m + "shared_experts.down_proj.weight"])
            for t in range(T):
                sel = sc[t, choice[t]]
                wt = sel / sel.sum() * cfg.routed_scaling_factor
                for e, we in zip(choice[t], wt):
                    ex = f"{m}experts.{e}."
                    y[t] += we * swiglu(x[t:t + 1], w[ex + "gate_proj.weight"], w[ex + "up_proj.weight"],
                                        w[ex + "down_proj.weight"])[0]
            h = h + y
        rms_after.append(float(np.sqrt((h * h).mean())))
    logits = _rms(h, w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
    assert np.isfinite(logits).all()
    assert all(0.5 < v < 4.0 for v in rms_after), rms_after
    assert all(0.15 < v < 0.9 for v in max_attn), max_attn          # neither uniform (~1/32) nor one-hot
    std = logits.std(axis=1)
    assert (std > 1.5).all() and (std < 6).all(), std
    assert len(set(logits.argmax(1).tolist())) > T // 3             # greedy does not collapse to one token
    assert bias_changed > 0                                         # the bias matters for the choice


@pytest.mark.oracle
def test_experts_decompress_with_compressed_tensors(tiny):
    """compressed-tensors' own pack-quantized decompressor, fed with the stored tensors (read by safetensors'
    torch reader, not our loader) and the scheme from config.json, gives our dequantize_bf16 bit for bit;
    our exact product is within one bf16 rounding of it."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    from ddtree_cupy.int4 import dequantize, dequantize_bf16

    target_dir, _ = tiny
    cfg = json.load(open(os.path.join(target_dir, "config.json")))
    wargs = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**wargs))
    wmap = json.load(open(os.path.join(target_dir, INDEX_FILE)))["weight_map"]
    files = {}
    for layer, e, proj in ((1, 0, "gate_proj"), (2, 17, "up_proj"), (3, 31, "down_proj")):
        base = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}"
        sd = {}
        for part in ("weight_packed", "weight_scale", "weight_shape"):
            f = wmap[f"{base}.{part}"]
            files.setdefault(f, load_file(os.path.join(target_dir, f)))
            sd[part] = files[f][f"{base}.{part}"]
        theirs = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        theirs = theirs.view(torch.int16).numpy().view(np.uint16)
        packed = sd["weight_packed"].numpy()
        scale = sd["weight_scale"].view(torch.int16).numpy().view(np.uint16)
        shape = sd["weight_shape"].numpy()
        np.testing.assert_array_equal(dequantize_bf16(packed, scale, shape), theirs)
        exact = dequantize(packed, scale, shape, np.float64)
        t = bf16_bits_to_f32(theirs).astype(np.float64)
        assert (np.abs(t - exact) <= np.abs(exact) * 2.0 ** -8).all()
