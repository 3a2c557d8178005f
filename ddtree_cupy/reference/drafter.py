"""DFlash block drafter in plain numpy: the golden model the GPU drafter is tested against.

A Qwen3-style decoder stack without embedding or LM head of its own (it borrows the target's). It sees the
target's COMMITTED tokens only through their features (outputs of target layers ``target_layer_ids``) and
drafts a whole block in one non-causal pass. See shared/design/DFLASH_DDTREE.md.

Per committed token (``append_context``):
    ctx = hidden_norm(fc(concat_l feats[l]))
    for each draft layer: K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx)  -> appended to that layer's cache
    (no input_layernorm on the context: the context is already normalised by hidden_norm)
Per draft (``draft``), committed length s, pending bonus b:
    h = target.embed_tokens([b, MASK, ..., MASK])             # block_size rows at positions s .. s+bs-1
    per layer: pre-norm attention (q/k/v_proj, per-head q_norm/k_norm, RoPE), queries = block rows only,
               keys/values = visible context ++ the block's own rows, NOT causal; o_proj; pre-norm SwiGLU MLP
    logits = target.lm_head(norm(h)[1:])                        # block row j (1-based) -> token at s + j
The block's K/V never enters the cache.

RoPE is NeoX "rotate-half" (pairs (i, i + d/2)), as in Qwen3, with the drafter's own RopeConfig (YaRN
inv_freq over head_dim) and cos/sin amplitude ``DrafterConfig.effective_rope_amplitude``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import math

import numpy as np

from ..config import DrafterConfig
from .norm import rms_norm
from .rope import apply_rope_rotate_half, yarn_inv_freq
from .vocab import vocab_embed, vocab_project

# The drafter's RoPE frequencies are the target's YaRN formula over head_dim (one implementation).
rope_inv_freq = yarn_inv_freq


# --------------------------------------------------------------------------------------------------
# math helpers (small on purpose: the tests recompute each one another way)

def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# --------------------------------------------------------------------------------------------------

LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")


def drafter_weight_shapes(cfg: DrafterConfig, tp_size: int = 1) -> Dict[str, tuple]:
    """Every tensor the drafter needs, by its (unprefixed) name, with its HF shape [out, in], for one rank's
    shard at tensor-parallel size ``tp_size`` (heads and the MLP width split; norms and fc replicated)."""
    cfg.validate_tp(tp_size)
    H, hd, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp_size
    nh, kvh = cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size
    per = {"input_layernorm.weight": (H,), "self_attn.q_proj.weight": (nh * hd, H),
           "self_attn.k_proj.weight": (kvh * hd, H), "self_attn.v_proj.weight": (kvh * hd, H),
           "self_attn.o_proj.weight": (H, nh * hd), "self_attn.q_norm.weight": (hd,),
           "self_attn.k_norm.weight": (hd,), "post_attention_layernorm.weight": (H,),
           "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F)}
    shapes = {"fc.weight": (H, cfg.num_context_features * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        for k, s in per.items():
            shapes[f"layers.{i}.{k}"] = s
    return shapes


@dataclass
class DrafterCache:
    """One stream's drafter context: per layer K and V rows [n, kv_heads, head_dim] in position order."""
    k: List[np.ndarray]
    v: List[np.ndarray]
    positions: np.ndarray
    length: int = 0
    # committed token ids (unused by DFlash; drafters that need them, e.g. test oracles, read them)
    tokens: List[int] = field(default_factory=list)

    def _grow(self, need: int) -> None:
        cap = self.positions.shape[0]
        if need <= cap:
            return
        new = max(need, 2 * cap, 16)
        for lst in (self.k, self.v):
            for i, a in enumerate(lst):
                b = np.empty((new,) + a.shape[1:], a.dtype)
                b[:self.length] = a[:self.length]
                lst[i] = b
        p = np.empty(new, np.int64)
        p[:self.length] = self.positions[:self.length]
        self.positions = p


class ReferenceDrafter:
    """numpy DFlash drafter. ``embed_tokens`` and ``lm_head`` are the TARGET's tensors ([V, H], or this
    rank's [V/tp, H] vocabulary slice under tensor parallelism, as ReferenceTarget holds them).

    Tensor parallel with ``comm`` of size > 1: ``weights`` is this rank's shard (local query and KV heads,
    local MLP width); o_proj and down_proj partial sums are all-reduced; the embedding and the logits are
    vocabulary-parallel (reference.vocab), so ``draft`` returns the same full logits on every rank.
    """

    def __init__(self, cfg: DrafterConfig, weights: Mapping[str, np.ndarray], embed_tokens: np.ndarray,
                 lm_head: np.ndarray, dtype=np.float32, comm=None):
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"ReferenceDrafter: dtype must be float32 or float64, got {dtype}")
        self.cfg, self.dtype = cfg, dtype
        from ..dist import SingleRank
        self.comm = comm if comm is not None else SingleRank()
        tp = self.comm.size
        cfg.validate_tp(tp)
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        # Checkpoints may carry a "model." prefix on the stack's tensors; the math does not care.
        w = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in weights.items()}
        self.w: Dict[str, np.ndarray] = {}
        for name, shape in drafter_weight_shapes(cfg, tp).items():
            if name not in w:
                raise ValueError(f"drafter weights: missing tensor '{name}' (shape {shape})")
            a = np.asarray(w[name])
            if tuple(a.shape) != shape:
                raise ValueError(f"drafter weights: '{name}' has shape {tuple(a.shape)}, expected {shape}")
            self.w[name] = a.astype(dtype)
        V, H = cfg.vocab_size // tp, cfg.hidden_size
        for nm, a in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(np.shape(a)) != (V, H):
                raise ValueError(f"ReferenceDrafter: target {nm} has shape {tuple(np.shape(a))}, expected {(V, H)}")
        self.embed = np.asarray(embed_tokens).astype(dtype)
        self.lm_head = np.asarray(lm_head).astype(dtype)
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.amplitude = float(cfg.effective_rope_amplitude)
        self.scale = cfg.head_dim ** -0.5

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def target_layer_ids(self):
        """Target layers whose outputs form the context features (what the decode loop captures)."""
        return self.cfg.target_layer_ids

    def new_cache(self) -> DrafterCache:
        c = self.cfg
        z = lambda: np.empty((0, self.n_kv_heads, c.head_dim), self.dtype)
        return DrafterCache(k=[z() for _ in range(c.num_hidden_layers)], v=[z() for _ in range(c.num_hidden_layers)],
                            positions=np.empty(0, np.int64))

    # ---- context ------------------------------------------------------------------------------
    def context_hidden(self, feats: np.ndarray) -> np.ndarray:
        """feats [T, n_feat, H] (target layers in target_layer_ids order) -> hidden_norm(fc(concat)) [T, H]."""
        c = self.cfg
        feats = np.asarray(feats)
        if feats.ndim != 3 or feats.shape[1:] != (c.num_context_features, c.hidden_size):
            raise ValueError(f"drafter context: feats must be [T, {c.num_context_features}, {c.hidden_size}], "
                             f"got {feats.shape}")
        x = feats.astype(self.dtype).reshape(feats.shape[0], -1)
        return rms_norm(x @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], c.rms_norm_eps)

    def _kv(self, layer: int, x: np.ndarray, positions: np.ndarray):
        c = self.cfg
        p = f"layers.{layer}.self_attn."
        k = (x @ self.w[p + "k_proj.weight"].T).reshape(-1, self.n_kv_heads, c.head_dim)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(-1, self.n_kv_heads, c.head_dim)
        k = rms_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps)
        return apply_rope_rotate_half(k, positions, self.inv_freq, self.amplitude).astype(self.dtype), v

    def append_context(self, cache: DrafterCache, feats: np.ndarray, positions: Sequence[int],
                       tokens: Optional[Sequence[int]] = None) -> None:
        """Add committed tokens (their target features, absolute positions, optionally their ids)."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        T = positions.shape[0]
        if np.shape(feats)[0] != T:
            raise ValueError(f"drafter context: {np.shape(feats)[0]} feature rows for {T} positions")
        if T == 0:
            return
        if cache.length and positions[0] <= cache.positions[cache.length - 1]:
            raise ValueError(f"drafter context: positions must increase (cache ends at "
                             f"{cache.positions[cache.length - 1]}, got {positions[0]})")
        ctx = self.context_hidden(feats)
        cache._grow(cache.length + T)
        for l in range(self.cfg.num_hidden_layers):
            k, v = self._kv(l, ctx, positions)
            cache.k[l][cache.length:cache.length + T] = k
            cache.v[l][cache.length:cache.length + T] = v
        cache.positions[cache.length:cache.length + T] = positions
        cache.length += T
        if tokens is not None:
            cache.tokens.extend(int(t) for t in tokens)

    def visible_rows(self, cache: DrafterCache) -> slice:
        """The context rows a draft attends: all, or the last ``draft_window``."""
        W = self.cfg.draft_window
        start = 0 if W is None else max(0, cache.length - W)
        return slice(start, cache.length)

    # ---- draft --------------------------------------------------------------------------------
    def draft_hidden(self, cache: DrafterCache, bonus: int, start_pos: int) -> np.ndarray:
        """Final-normed hidden states of the whole block [block_size, H] (row 0 = the bonus row)."""
        c = self.cfg
        bs, nh, kvh, hd = c.block_size, self.n_heads, self.n_kv_heads, c.head_dim
        if not 0 <= int(bonus) < c.vocab_size:
            raise ValueError(f"draft: bonus token {bonus} outside [0, {c.vocab_size})")
        ids = np.full(bs, c.mask_token_id, np.int64)
        ids[0] = int(bonus)
        pos = np.arange(start_pos, start_pos + bs, dtype=np.int64)
        vis = self.visible_rows(cache)
        g = nh // kvh
        h = vocab_embed(self.embed, ids, self.comm)
        for l in range(c.num_hidden_layers):
            p = f"layers.{l}."
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = (x @ self.w[p + "self_attn.q_proj.weight"].T).reshape(bs, nh, hd)
            q = apply_rope_rotate_half(rms_norm(q, self.w[p + "self_attn.q_norm.weight"], c.rms_norm_eps), pos,
                                       self.inv_freq, self.amplitude).astype(self.dtype)
            kb, vb = self._kv(l, x, pos)
            K = np.concatenate([cache.k[l][vis], kb], axis=0)          # [N, kvh, hd]
            V = np.concatenate([cache.v[l][vis], vb], axis=0)
            # GQA: query head h reads kv head h // g. Group the queries as [kvh, g*bs, hd].
            qg = q.reshape(bs, kvh, g, hd).transpose(1, 2, 0, 3).reshape(kvh, g * bs, hd)
            s = np.einsum("kqd,nkd->kqn", qg, K) * self.scale
            o = np.einsum("kqn,nkd->kqd", softmax(s, -1), V)           # no mask: the block is non-causal
            o = o.reshape(kvh, g, bs, hd).transpose(2, 0, 1, 3).reshape(bs, nh * hd)
            h = h + self.comm.all_reduce(np.ascontiguousarray(o @ self.w[p + "self_attn.o_proj.weight"].T))
            x = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            m = silu(x @ self.w[p + "mlp.gate_proj.weight"].T) * (x @ self.w[p + "mlp.up_proj.weight"].T)
            h = h + self.comm.all_reduce(np.ascontiguousarray(m @ self.w[p + "mlp.down_proj.weight"].T))
        return rms_norm(h, self.w["norm.weight"], c.rms_norm_eps)

    def draft(self, cache: DrafterCache, bonus: int, start_pos: int) -> np.ndarray:
        """Logits [block_size - 1, V]: row d-1 predicts the token at position start_pos + d (depth d)."""
        return vocab_project(self.draft_hidden(cache, bonus, start_pos)[1:], self.lm_head, self.comm)
