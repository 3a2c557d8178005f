"""Tiny checkpoints in the REAL Kimi K2.6 / DFlash formats, for tests and the demo.

``python -m ddtree_cupy.tinymodel OUT_DIR [--seed S] [--plain]`` writes ``OUT_DIR/target`` and
``OUT_DIR/drafter``:
  * target: the ``kimi_k25`` wrapper config.json (or, with ``--plain``, a plain DeepseekV3 config and
    unprefixed names), ``language_model.``-prefixed tensors in several ``model-0000N-of-0000M.safetensors``
    shards with ``model.safetensors.index.json``, a few ``vision_tower.*``/``mm_projector.*`` tensors a text
    engine must skip, INT4 routed experts (weight_packed int32, weight_scale bf16, weight_shape int32) made
    by our own ``quantize_groupwise`` (so the stored INT4 is exactly what kernels read), fp32
    ``e_score_correction_bias``, bf16 everything else; and a synthetic Kimi-style tokenizer
    (``tiktoken.model`` from a small deterministic BPE over an embedded English text + ``tokenizer_config.json``
    naming the 256 special ids with Kimi's offsets);
  * drafter: a DFlash drafter (``config.json`` + ``model.safetensors``), tensor names as z-lab's
    DFlashDraftModel saves them (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``,
    ``norm.weight``; no embedding or lm_head: it uses the target's).

Kernel-specialised dims (kv_lora_rank 512, rope 64, nope/v 128, head_dim 128, group 32) stay as in K2.6; the
rest is shrunk (see ``TinySpec``). Weights are Gaussian, scaled so activations look like a real model's:
hidden RMS O(1) through the layers, attention logits with std ~2 (softmax not saturated), final logits
with std of a few units. Everything is a deterministic function of the seed (same seed, same bytes).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import knobs
from .bf16 import to_bf16_bits
from .checkpoint import INDEX_FILE, SINGLE_FILE, WRAPPER_PREFIX, save_safetensors
from .config import DrafterConfig, QuantConfig, RopeConfig, TargetConfig
from .int4 import quantize_groupwise

FORMAT_VERSION = 1     # bump when the written bytes change for the same (seed, spec): invalidates caches

# Kimi's special-token offsets from the first special id (= number of BPE ranks); the rest are reserved.
SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                   10: "<|im_system|>", 17: "<|im_middle|>", 22: "<think>", 23: "</think>",
                   254: "[UNK]", 255: "[PAD]"}
NUM_SPECIAL = 256
QUANT_IGNORE = ("re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*")


@dataclass(frozen=True)
class TinySpec:
    # target
    vocab_size: int = 1024                 # BPE ranks = vocab_size - 256, then 256 specials
    hidden_size: int = 512
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 8
    q_lora_rank: int = 256
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 1024
    moe_intermediate_size: int = 256
    n_routed_experts: int = 32
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    rope_factor: float = 64.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    num_shards: int = 4
    # drafter
    drafter_hidden_layers: int = 2
    drafter_attention_heads: int = 16
    drafter_kv_heads: int = 8
    drafter_head_dim: int = 128
    drafter_intermediate_size: int = 1024
    drafter_block_size: int = 8
    drafter_target_layer_ids: Tuple[int, ...] = (1, 2, 3)
    drafter_rms_norm_eps: float = 1e-6
    # scales (see the module docstring)
    embed_std: float = 1.0
    lm_head_gain: float = 3.0
    out_proj_gain: float = 0.7             # o_proj and down_proj: how much each block adds to the residual
    router_bias_std: float = 0.05
    norm_weight_jitter: float = 0.1

    @property
    def n_ranks(self) -> int:
        return self.vocab_size - NUM_SPECIAL

    def special_id(self, name: str) -> int:
        off = {v: k for k, v in SPECIAL_OFFSETS.items()}[name]
        return self.n_ranks + off

    def rope(self) -> RopeConfig:
        return RopeConfig(theta=self.rope_theta, kind="yarn", factor=self.rope_factor,
                          original_max_position_embeddings=self.rope_original_max_position_embeddings,
                          beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow,
                          mscale=self.rope_mscale, mscale_all_dim=self.rope_mscale_all_dim)

    def target_config(self, plain: bool = False) -> TargetConfig:
        cfg = TargetConfig(
            num_hidden_layers=self.num_hidden_layers, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=self.n_shared_experts, first_k_dense_replace=self.first_k_dense_replace,
            moe_layer_freq=1, num_attention_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, vocab_size=self.vocab_size,
            rope=self.rope(), max_position_embeddings=self.max_position_embeddings,
            routed_scaling_factor=self.routed_scaling_factor, scoring_func="sigmoid", topk_method="noaux_tc",
            n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=True, rms_norm_eps=self.rms_norm_eps,
            bos_token_id=self.special_id("[BOS]"), eos_token_id=self.special_id("<|im_end|>"),
            pad_token_id=self.special_id("[PAD]"), quant=QuantConfig(ignore=QUANT_IGNORE),
            weight_prefix="" if plain else WRAPPER_PREFIX, source="<tinymodel>")
        cfg.validate()
        return cfg

    def drafter_config(self) -> DrafterConfig:
        cfg = DrafterConfig(
            hidden_size=self.hidden_size, intermediate_size=self.drafter_intermediate_size,
            num_hidden_layers=self.drafter_hidden_layers, num_attention_heads=self.drafter_attention_heads,
            num_key_value_heads=self.drafter_kv_heads, head_dim=self.drafter_head_dim,
            vocab_size=self.vocab_size, rms_norm_eps=self.drafter_rms_norm_eps, rope=self.rope(),
            block_size=self.drafter_block_size, target_layer_ids=tuple(self.drafter_target_layer_ids),
            mask_token_id=self.special_id("[UNK]"), num_target_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings, source="<tinymodel>")
        cfg.validate()
        return cfg


# --------------------------------------------------------------------------------------------------
# weights

class _Gen:
    """Draws every tensor from one seeded stream, in a fixed order, so bytes depend only on (seed, spec)."""

    def __init__(self, seed: int, spec: TinySpec):
        self.rng = np.random.default_rng(seed)
        self.spec = spec

    def normal(self, shape, std: float) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def linear(self, n_out: int, n_in: int, gain: float = 1.0) -> Tuple[str, np.ndarray]:
        # std gain/sqrt(K): an input of RMS 1 gives outputs of RMS ~gain
        return "BF16", to_bf16_bits(self.normal((n_out, n_in), gain / np.sqrt(n_in)))

    def norm(self, n: int) -> Tuple[str, np.ndarray]:
        return "BF16", to_bf16_bits(1.0 + self.normal((n,), self.spec.norm_weight_jitter))

    def int4(self, base: str, out: dict, n_out: int, n_in: int, gain: float = 1.0) -> None:
        packed, scale = quantize_groupwise(self.normal((n_out, n_in), gain / np.sqrt(n_in)))
        out[base + ".weight_packed"] = packed
        out[base + ".weight_scale"] = ("BF16", scale)
        out[base + ".weight_shape"] = np.array([n_out, n_in], dtype=np.int32)


def target_tensors(seed: int, spec: TinySpec) -> Dict[str, object]:
    """{unprefixed name: array or (dtype, array)} of the tiny target, in checkpoint order."""
    g, s = _Gen(seed, spec), spec
    H, nh = s.hidden_size, s.num_attention_heads
    og = s.out_proj_gain
    t: Dict[str, object] = {"model.embed_tokens.weight": ("BF16", to_bf16_bits(g.normal((s.vocab_size, H), s.embed_std)))}
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = g.norm(H)
        a = p + "self_attn."
        t[a + "q_a_proj.weight"] = g.linear(s.q_lora_rank, H)
        t[a + "q_a_layernorm.weight"] = g.norm(s.q_lora_rank)
        t[a + "q_b_proj.weight"] = g.linear(nh * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank)
        t[a + "kv_a_proj_with_mqa.weight"] = g.linear(s.kv_lora_rank + s.qk_rope_head_dim, H)
        t[a + "kv_a_layernorm.weight"] = g.norm(s.kv_lora_rank)
        t[a + "kv_b_proj.weight"] = g.linear(nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        t[a + "o_proj.weight"] = g.linear(H, nh * s.v_head_dim, og)
        t[p + "post_attention_layernorm.weight"] = g.norm(H)
        m = p + "mlp."
        if i < s.first_k_dense_replace:
            t[m + "gate_proj.weight"] = g.linear(s.intermediate_size, H)
            t[m + "up_proj.weight"] = g.linear(s.intermediate_size, H)
            t[m + "down_proj.weight"] = g.linear(H, s.intermediate_size, og)
            continue
        I = s.moe_intermediate_size
        t[m + "gate.weight"] = g.linear(s.n_routed_experts, H)
        t[m + "gate.e_score_correction_bias"] = g.normal((s.n_routed_experts,), s.router_bias_std)  # fp32
        Is = I * s.n_shared_experts
        t[m + "shared_experts.gate_proj.weight"] = g.linear(Is, H)
        t[m + "shared_experts.up_proj.weight"] = g.linear(Is, H)
        t[m + "shared_experts.down_proj.weight"] = g.linear(H, Is, og)
        # routed experts: k of them add up with weights summing to routed_scaling_factor; scale down so
        # the routed sum is about as large as one shared expert's output
        eg = og / np.sqrt(s.routed_scaling_factor * s.num_experts_per_tok ** 0.5)
        for e in range(s.n_routed_experts):
            x = f"{m}experts.{e}."
            g.int4(x + "gate_proj", t, I, H)
            g.int4(x + "up_proj", t, I, H)
            g.int4(x + "down_proj", t, H, I, eg)
    t["model.norm.weight"] = g.norm(H)
    t["lm_head.weight"] = g.linear(s.vocab_size, H, s.lm_head_gain)
    return t


def drafter_tensors(seed: int, spec: TinySpec) -> Dict[str, object]:
    g, s = _Gen(seed + 0x5EED, spec), spec        # a stream distinct from the target's
    H, hd = s.hidden_size, s.drafter_head_dim
    nq, nkv, I = s.drafter_attention_heads * hd, s.drafter_kv_heads * hd, s.drafter_intermediate_size
    t: Dict[str, object] = {}
    for i in range(s.drafter_hidden_layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = g.norm(H)
        t[p + "self_attn.q_proj.weight"] = g.linear(nq, H)
        t[p + "self_attn.k_proj.weight"] = g.linear(nkv, H)
        t[p + "self_attn.v_proj.weight"] = g.linear(nkv, H)
        t[p + "self_attn.o_proj.weight"] = g.linear(H, nq, s.out_proj_gain)
        t[p + "self_attn.q_norm.weight"] = g.norm(hd)
        t[p + "self_attn.k_norm.weight"] = g.norm(hd)
        t[p + "post_attention_layernorm.weight"] = g.norm(H)
        t[p + "mlp.gate_proj.weight"] = g.linear(I, H)
        t[p + "mlp.up_proj.weight"] = g.linear(I, H)
        t[p + "mlp.down_proj.weight"] = g.linear(H, I, s.out_proj_gain)
    t["norm.weight"] = g.norm(H)
    t["fc.weight"] = g.linear(H, len(s.drafter_target_layer_ids) * H)
    t["hidden_norm.weight"] = g.norm(H)
    return t


def _vision_tensors(seed: int) -> Dict[str, object]:
    """A few stand-ins for the K2.5/K2.6 vision tower and projector (a text engine must skip them)."""
    g = np.random.default_rng(seed + 0x7151)
    bits = lambda *shape: ("BF16", to_bf16_bits(g.standard_normal(shape, dtype=np.float32) * 0.02))
    return {"vision_tower.patch_embed.proj.weight": bits(64, 3, 2, 2),
            "vision_tower.encoder.blocks.0.wqkv.weight": bits(192, 64),
            "mm_projector.proj.0.weight": bits(128, 64),
            "mm_projector.proj.0.bias": bits(128)}


def _nbytes(v) -> int:
    return (v[1] if isinstance(v, tuple) else v).nbytes


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_tiny_target(out_dir: str, seed: int = 0, spec: Optional[TinySpec] = None, plain: bool = False) -> str:
    """Write the tiny target checkpoint (config, shards, index, tokenizer) into ``out_dir``; returns it."""
    spec = spec or TinySpec()
    cfg = spec.target_config(plain)
    os.makedirs(out_dir, exist_ok=True)
    prefix = "" if plain else WRAPPER_PREFIX
    tensors = {prefix + k: v for k, v in target_tensors(seed, spec).items()}
    if not plain:
        vis = _vision_tensors(seed)
        items = list(tensors.items())
        # vision tensors at both ends so that both the first and the last shard hold something to skip
        half = len(vis) // 2
        vitems = list(vis.items())
        tensors = dict(vitems[:half] + items + vitems[half:])
    # shards of about equal size, in checkpoint order (a layer may straddle two shards, as in the real files)
    total = sum(_nbytes(v) for v in tensors.values())
    m = max(1, spec.num_shards)
    shards: List[Dict[str, object]] = [{} for _ in range(m)]
    acc = 0
    for name, v in tensors.items():
        k = min(m - 1, acc * m // total)
        shards[k][name] = v
        acc += _nbytes(v)
    shards = [s for s in shards if s]
    m = len(shards)
    weight_map: Dict[str, str] = {}
    for k, sh in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{m:05d}.safetensors"
        save_safetensors(os.path.join(out_dir, fname), sh, {"format": "pt"})
        weight_map.update({name: fname for name in sh})
    _write_json(os.path.join(out_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(out_dir, "config.json"), cfg.to_dict(wrapper=not plain))
    write_tokenizer(out_dir, spec)
    return out_dir


def write_tiny_drafter(out_dir: str, seed: int = 0, spec: Optional[TinySpec] = None) -> str:
    """Write the tiny DFlash drafter (config.json + a single model.safetensors) into ``out_dir``."""
    spec = spec or TinySpec()
    cfg = spec.drafter_config()
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(os.path.join(out_dir, SINGLE_FILE), drafter_tensors(seed, spec), {"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), cfg.to_dict())
    return out_dir


def _spec_key(seed: int, spec: TinySpec) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "seed": seed, "spec": asdict(spec)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> str:
    base = knobs.get().cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ddtree_cupy")
    return os.path.join(base, "tiny")


def ensure_tiny_checkpoints(cache_dir: Optional[str] = None, seed: int = 0,
                            spec: Optional[TinySpec] = None) -> Tuple[str, str]:
    """(target_dir, drafter_dir) of the tiny checkpoints for (seed, spec), generated once into ``cache_dir``
    (default ``$DDTREE_CUPY_CACHE/tiny`` or ``~/.cache/ddtree_cupy/tiny``) and reused afterwards.
    Generation happens in a temporary directory renamed into place, so concurrent callers (parallel test
    workers) never see a half-written checkpoint."""
    spec = spec or TinySpec()
    cache_dir = cache_dir or default_cache_dir()
    final = os.path.join(cache_dir, f"seed{seed}-{_spec_key(seed, spec)}")
    target, drafter = os.path.join(final, "target"), os.path.join(final, "drafter")
    if os.path.exists(os.path.join(final, "COMPLETE")):
        return target, drafter
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir)
    try:
        write_tiny_target(os.path.join(tmp, "target"), seed, spec)
        write_tiny_drafter(os.path.join(tmp, "drafter"), seed, spec)
        open(os.path.join(tmp, "COMPLETE"), "w").close()
        try:
            os.rename(tmp, final)
        except OSError:
            # another process finished first (or a stale incomplete dir is in the way)
            if not os.path.exists(os.path.join(final, "COMPLETE")):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target, drafter


# --------------------------------------------------------------------------------------------------
# tokenizer

# Training text for the synthetic BPE (written for this project). Variety of common English words, some
# digits and punctuation, so merges look like a real tokenizer's (" the", "ing", " and", ...).
_TEXT = """\
The river town woke slowly on the first cold morning of the year. Smoke rose from the chimneys, and the
baker opened his doors at six o'clock, as he had done every day for thirty-two years. Children walked to
school along the water, counting the boats that were tied to the old stone wall: one, two, three, and a
small red one that nobody seemed to own. Their teacher, a patient woman with a loud laugh, asked them to
write about something they had seen on the way. Most of them wrote about the boats. One boy wrote about
the bridge, which he said was older than the town itself, and he was right.

In the afternoon the wind changed. Clouds came down from the hills and the light turned grey and soft.
The fishermen looked at the sky, talked quietly among themselves, and decided to stay on shore. They
repaired their nets, painted the hulls, and told each other stories they had all heard many times before.
Someone brought tea; someone else brought bread and cheese. It was, as one of them said, a good day for
doing nothing in particular, which is harder than it sounds.

Numbers matter in a place like this. The tide rises about 4 metres twice a day; the market opens at 7 and
closes at 13; the ferry takes 45 minutes to cross, or 50 when the water is rough. In 1987 the great flood
reached the steps of the church, and a line painted on the wall still shows how high it came. People
remember such things because they shape the way they live: where they build, when they travel, what they
keep in the house for the winter.

Learning to read the weather is like learning a language. At first every sign means nothing. Later you
notice patterns: the swallows flying low before rain, the smell of the air before snow, the colour of the
sea before a storm. Then one day you understand without thinking, and you wonder how you ever missed it.
The old sailors say that the sea is always teaching, but only patient students learn anything at all.

When evening came, the lamps were lit along the harbour and the town grew quiet. A dog barked somewhere,
a door closed, and the last bus left for the city. In the small kitchen above the bakery, the baker wrote
in his notebook, as he did every night: the date, the number of loaves he had sold, and one sentence
about the day. Tonight he wrote: "Cold, grey, calm. The children counted the boats again."

Questions are the beginning of every good answer. Why does the water rise? How far is the city? Who
built the bridge, and what were they thinking when they chose that stone? The teacher believed that a
question asked honestly was worth more than a quick answer, and she taught her students to write their
questions down, to return to them later, and to be proud of the ones they could not yet answer.
"""

# Training-time pre-tokenization, close to Kimi's pattern: a word with at most one leading non-letter,
# numbers in runs of 1..3 digits, punctuation runs, newlines, spaces.
_PRETOKEN = re.compile(r"[^\r\n\w]?[A-Za-z]+|\d{1,3}| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=8)
def bpe_ranks(n_ranks: int) -> Tuple[bytes, ...]:
    """Tokens by rank: the 256 single bytes, then merges learned by byte-level BPE over ``_TEXT``.

    Each step merges the most frequent adjacent pair (ties: the smaller (left, right) bytes), so the result
    is deterministic. A merge whose bytes already exist as a token is applied without a new rank. If the text
    runs out of pairs, concatenations of earlier tokens (in rank order) fill the table.
    """
    if n_ranks < 256:
        raise ValueError(f"bpe_ranks: need at least 256 ranks (all single bytes), got {n_ranks}")
    ranks: List[bytes] = [bytes([b]) for b in range(256)]
    known = set(ranks)
    words = Counter(tuple(bytes([b]) for b in w.encode("utf-8")) for w in _PRETOKEN.findall(_TEXT))
    words = {w: c for w, c in words.items() if len(w) > 1}
    while len(ranks) < n_ranks and words:
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        if merged not in known:
            known.add(merged)
            ranks.append(merged)
        new_words: Dict[tuple, int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            if len(out) > 1:
                new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    # filler, only when the text is exhausted: printable-ASCII strings of length 2, 3, ... in order
    length = 2
    while len(ranks) < n_ranks:
        for combo in itertools.product(range(32, 127), repeat=length):
            cand = bytes(combo)
            if cand not in known:
                known.add(cand)
                ranks.append(cand)
                if len(ranks) == n_ranks:
                    break
        length += 1
    return tuple(ranks[:n_ranks])


def special_tokens(n_ranks: int) -> Dict[int, str]:
    """{id: name} of the 256 special ids that follow the BPE ranks, with Kimi's offsets."""
    return {n_ranks + off: SPECIAL_OFFSETS.get(off, f"<|reserved_token_{n_ranks + off}|>")
            for off in range(NUM_SPECIAL)}


def write_tokenizer(out_dir: str, spec: Optional[TinySpec] = None) -> None:
    """``tiktoken.model`` (``base64(token) rank`` lines) and ``tokenizer_config.json`` into ``out_dir``."""
    spec = spec or TinySpec()
    ranks = bpe_ranks(spec.n_ranks)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for r, tok in enumerate(ranks):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {r}\n")
    specials = special_tokens(spec.n_ranks)
    cfg = {
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, name in specials.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                      "<|im_middle|>"],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "TikTokenTokenizer",
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), cfg)


# --------------------------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    from .run import HelpWithDefaults
    ap = argparse.ArgumentParser(prog="python -m ddtree_cupy.tinymodel", formatter_class=HelpWithDefaults,
                                 description="Write tiny Kimi-K2.6-format target and DFlash drafter checkpoints.")
    ap.add_argument("out_dir", help="writes OUT_DIR/target and OUT_DIR/drafter")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    ap.add_argument("--plain", action="store_true",
                    help="plain DeepseekV3 config and unprefixed names (K2-Thinking style), no vision tensors")
    args = ap.parse_args(argv)
    t = write_tiny_target(os.path.join(args.out_dir, "target"), args.seed, plain=args.plain)
    d = write_tiny_drafter(os.path.join(args.out_dir, "drafter"), args.seed)
    print(f"target:  {t}\ndrafter: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
