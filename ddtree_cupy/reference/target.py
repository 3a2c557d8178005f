"""Golden numpy model of the Kimi K2 / DeepSeek-V3 target (float32 or float64), with its latent KV cache.

Everything GPU code is tested against. Plain numpy, no speed tricks beyond batching over tokens.
Conventions (docs/REFERENCE.md has the details and how they were checked against HF transformers):
  * RMSNorm eps: ``rms_norm_eps`` for input / post-attention / final norms, ``latent_norm_eps`` for the
    q_a / kv_a latent norms.
  * RoPE on adjacent pairs of the d_rope parts, YaRN frequencies and cos/sin amplitude from ``cfg.rope``;
    the cache holds the rotated k_pe in that same adjacent layout.
  * softmax scale ``cfg.softmax_scale`` (qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2).
  * noaux_tc routing, weights from the unbiased sigmoid scores (see moe.route).
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import numpy as np

from ..config import TargetConfig
from .mla import mla_attention_absorbed, mla_attention_naive, split_kv_b
from .moe import moe_experts, route, swiglu_mlp
from .norm import rms_norm
from .rope import apply_rope_adjacent, yarn_inv_freq
from .vocab import vocab_embed, vocab_project

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def expected_weight_shapes(cfg: TargetConfig, tp_size: int = 1) -> Dict[str, Tuple[int, ...]]:
    """Every tensor the reference needs (unprefixed HF names, routed experts dequantized) -> its shape,
    for one rank's shard at tensor-parallel size ``tp_size`` (checkpoint.tp_split holds the plan: heads,
    FFN widths and the vocabulary are split; everything else is replicated)."""
    cfg.validate_tp(tp_size)
    H, nh, V = cfg.hidden_size, cfg.num_attention_heads // tp_size, cfg.vocab_size // tp_size
    out: Dict[str, Tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
            p + "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
            p + "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            p + "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim),
        })
        if cfg.is_moe_layer(i):
            I, E = cfg.moe_intermediate_size // tp_size, cfg.n_routed_experts
            out[p + "mlp.gate.weight"] = (E, H)
            out[p + "mlp.gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out.update({q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H),
                            q + "down_proj.weight": (H, I)})
            if cfg.n_shared_experts:
                Is = I * cfg.n_shared_experts
                out.update({p + "mlp.shared_experts.gate_proj.weight": (Is, H),
                            p + "mlp.shared_experts.up_proj.weight": (Is, H),
                            p + "mlp.shared_experts.down_proj.weight": (H, Is)})
        else:
            F = cfg.intermediate_size // tp_size
            out.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                        p + "mlp.down_proj.weight": (H, F)})
    return out


# --------------------------------------------------------------------------------------------------

class LatentKVCache:
    """Per layer a growing array [length, kv_lora_rank + qk_rope_head_dim] of (normalised c_kv | rotated k_pe).

    Row p of every layer belongs to cache position p. Storage grows by doubling so token-by-token decode stays
    linear; ``layer(l)`` returns a read-only view of the valid rows.
    """

    def __init__(self, num_layers: int, width: int, dtype=np.float64):
        if num_layers <= 0 or width <= 0:
            raise ValueError(f"LatentKVCache: num_layers ({num_layers}) and width ({width}) must be positive")
        self.num_layers = int(num_layers)
        self.width = int(width)
        self.dtype = np.dtype(dtype)
        self._buf = np.empty((self.num_layers, 16, self.width), self.dtype)
        self._len = 0

    @property
    def length(self) -> int:
        return self._len

    def __len__(self) -> int:
        return self._len

    def layer(self, l: int) -> np.ndarray:
        if not 0 <= l < self.num_layers:
            raise ValueError(f"LatentKVCache.layer: layer {l} out of range [0, {self.num_layers})")
        v = self._buf[l, :self._len]
        v.flags.writeable = False
        return v

    def append(self, rows) -> None:
        """Append T rows to every layer: ``rows`` is [num_layers, T, width] (array or per-layer sequence)."""
        rows = np.asarray(rows)
        if rows.ndim != 3 or rows.shape[0] != self.num_layers or rows.shape[2] != self.width:
            raise ValueError(f"LatentKVCache.append: rows has shape {rows.shape}, expected "
                             f"[{self.num_layers}, T, {self.width}]")
        n = self._len + rows.shape[1]
        if n > self._buf.shape[1]:
            cap = max(n, 2 * self._buf.shape[1])
            buf = np.empty((self.num_layers, cap, self.width), self.dtype)
            buf[:, :self._len] = self._buf[:, :self._len]
            self._buf = buf
        self._buf[:, self._len:n] = rows
        self._len = n

    def truncate(self, n: int) -> None:
        """Keep rows [0, n)."""
        if not 0 <= n <= self._len:
            raise ValueError(f"LatentKVCache.truncate: n={n} outside [0, {self._len}]")
        self._len = int(n)

    def commit(self, prefix_len: int, rows: Sequence[int]) -> None:
        """Keep rows [0, prefix_len), then move the absolute rows ``rows`` (in the given order) to
        prefix_len, prefix_len + 1, ...; everything else is dropped. Used after tree verification."""
        if not 0 <= prefix_len <= self._len:
            raise ValueError(f"LatentKVCache.commit: prefix_len={prefix_len} outside [0, {self._len}]")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        bad = rows[(rows < prefix_len) | (rows >= self._len)]
        if bad.size:
            raise ValueError(f"LatentKVCache.commit: rows {bad.tolist()} outside [{prefix_len}, {self._len})")
        if np.unique(rows).size != rows.size:
            raise ValueError(f"LatentKVCache.commit: rows has duplicates: {rows.tolist()}")
        moved = self._buf[:, rows].copy()      # gather first: a destination may be another listed source
        self._buf[:, prefix_len:prefix_len + rows.size] = moved
        self._len = prefix_len + rows.size

    def copy(self) -> "LatentKVCache":
        c = LatentKVCache(self.num_layers, self.width, self.dtype)
        c.append(self._buf[:, :self._len])
        return c


# --------------------------------------------------------------------------------------------------

class ReferenceTarget:
    """The target model in numpy. ``attention`` selects 'absorbed' (default) or 'naive' MLA.

    Tensor parallel: with ``comm`` of size > 1, ``weights`` is this rank's shard
    (``checkpoint.load_reference_weights(..., tp_rank, tp_size)``): local heads, local FFN widths, a slice
    of the vocabulary. The partial outputs of o_proj and of the MLP (routed + shared together) are summed
    with one all-reduce each, the embedding is vocabulary-parallel (rows outside the shard give zeros,
    then an all-reduce), and the logits are gathered, so ``forward`` returns the same full logits and the
    same latent cache (replicated) on every rank as TP = 1 does, up to summation order.
    """

    def __init__(self, cfg: TargetConfig, weights: Mapping[str, np.ndarray], dtype=np.float64,
                 attention: str = "absorbed", comm=None):
        if not isinstance(cfg, TargetConfig):
            raise ValueError(f"ReferenceTarget: cfg must be a TargetConfig, got {type(cfg).__name__}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DTYPES:
            raise ValueError(f"ReferenceTarget: dtype must be float32 or float64, got {self.dtype}")
        if attention not in ("absorbed", "naive"):
            raise ValueError(f"ReferenceTarget: attention must be 'absorbed' or 'naive', got {attention!r}")
        self.cfg = cfg
        self.attention = attention
        from ..dist import SingleRank
        self.comm = comm if comm is not None else SingleRank()
        self.tp_rank, self.tp_size = self.comm.rank, self.comm.size
        cfg.validate_tp(self.tp_size)
        self.n_heads = cfg.num_attention_heads // self.tp_size          # local heads
        self.w = self._load(cfg, weights)
        self.inv_freq = yarn_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
        self.amplitude = cfg.rope.amplitude

    # ---- weights ------------------------------------------------------------------------------
    def _load(self, cfg: TargetConfig, weights: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Check every needed tensor (present, shape, float, finite) and convert it to self.dtype.
        Routed experts go straight into per-layer stacks [E, I, H] / [E, H, I] (what the math indexes);
        they are not kept a second time by name."""
        w: Dict[str, np.ndarray] = {}
        expert_stacks: Dict[Tuple[int, str], np.ndarray] = {}
        for name, shape in expected_weight_shapes(cfg, self.tp_size).items():
            if name not in weights:
                hint = ""
                if cfg.weight_prefix + name in weights or "language_model." + name in weights:
                    hint = " (found it with the 'language_model.' prefix: strip the prefix, see CONTRACTS.md)"
                raise ValueError(f"ReferenceTarget: missing weight tensor '{name}' with shape {shape}{hint}")
            a = np.asarray(weights[name])
            if a.shape != shape:
                raise ValueError(f"ReferenceTarget: weight tensor '{name}' has shape {a.shape}, expected {shape}")
            if a.dtype.kind != "f":
                raise ValueError(f"ReferenceTarget: weight tensor '{name}' has dtype {a.dtype}, expected a float "
                                 f"type (decode bf16 bit patterns with bf16.bf16_bits_to_f32 first)")
            if not np.isfinite(a).all():
                raise ValueError(f"ReferenceTarget: weight tensor '{name}' holds non-finite values")
            if ".mlp.experts." in name:
                # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
                parts = name.split(".")
                layer, e, kind = int(parts[2]), int(parts[5]), parts[6][:-len("_proj")]
                key = (layer, kind)
                if key not in expert_stacks:
                    expert_stacks[key] = np.empty((cfg.n_routed_experts,) + shape, self.dtype)
                expert_stacks[key][e] = a
            else:
                w[name] = a.astype(self.dtype)     # a private copy: later edits of the caller's dict do not leak in
        # per layer: the W_UK / W_UV split of kv_b_proj and the stacked experts (None for dense layers)
        self._uk_uv = []
        self._experts = []
        for i in range(cfg.num_hidden_layers):
            self._uk_uv.append(split_kv_b(w[f"model.layers.{i}.self_attn.kv_b_proj.weight"], self.n_heads,
                                          cfg.qk_nope_head_dim, cfg.v_head_dim))
            self._experts.append(tuple(expert_stacks[(i, k)] for k in ("gate", "up", "down"))
                                 if cfg.is_moe_layer(i) else None)
        return w

    @property
    def embed_tokens(self) -> np.ndarray:
        """``model.embed_tokens.weight`` in self.dtype: [V, H], or this rank's [V/tp, H] vocabulary slice."""
        return self.w["model.embed_tokens.weight"]

    @property
    def lm_head(self) -> np.ndarray:
        """``lm_head.weight`` in self.dtype: [V, H], or this rank's [V/tp, H] vocabulary slice."""
        return self.w["lm_head.weight"]

    def project_vocab(self, x: np.ndarray) -> np.ndarray:
        """Full logits [T, V] = x @ lm_head^T (vocabulary-parallel: local slice, then gathered)."""
        return vocab_project(x, self.w["lm_head.weight"], self.comm)

    # ---- cache --------------------------------------------------------------------------------
    def new_cache(self) -> LatentKVCache:
        return LatentKVCache(self.cfg.num_hidden_layers, self.cfg.kv_cache_dim, self.dtype)

    # ---- layers -------------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding rows [T, H] (vocabulary-parallel: rows outside this rank's slice are zero, then summed)."""
        return vocab_embed(self.w["model.embed_tokens.weight"], tokens, self.comm)

    def attention_block(self, i: int, x: np.ndarray, positions: np.ndarray, past: np.ndarray,
                        allowed_new: np.ndarray):
        """Layer i's MLA on normed input x [T, H]. ``past``: cache rows [S0, 576] before this call;
        ``allowed_new`` bool [T, T]. Returns (output [T, H], the T new cache rows [T, 576])."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}.self_attn."
        T, nh, dn, dr, r = x.shape[0], self.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        c_q = rms_norm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], cfg.latent_norm_eps)
        q = (c_q @ w[p + "q_b_proj.weight"].T).reshape(T, nh, dn + dr)
        q_nope = q[:, :, :dn]
        q_pe = apply_rope_adjacent(q[:, :, dn:], positions, self.inv_freq, self.amplitude)
        kv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        c_kv = rms_norm(kv[:, :r], w[p + "kv_a_layernorm.weight"], cfg.latent_norm_eps)
        k_pe = apply_rope_adjacent(kv[:, r:], positions, self.inv_freq, self.amplitude)
        new_rows = np.concatenate([c_kv, k_pe], axis=1)
        latent = np.concatenate([past, new_rows], axis=0)
        allowed = np.concatenate([np.ones((T, past.shape[0]), bool), allowed_new], axis=1)
        w_uk, w_uv = self._uk_uv[i]
        attn = mla_attention_absorbed if self.attention == "absorbed" else mla_attention_naive
        o = attn(q_nope, q_pe, latent, w_uk, w_uv, allowed, cfg.softmax_scale)   # [T, nh, dv]
        # o_proj is split by input columns under TP: each rank holds a partial sum of the output.
        out = self.comm.all_reduce(np.ascontiguousarray(o.reshape(T, nh * cfg.v_head_dim) @ w[p + "o_proj.weight"].T))
        return out, new_rows

    def mlp_block(self, i: int, x: np.ndarray) -> np.ndarray:
        """Layer i's MLP on normed input x [T, H]: dense SwiGLU, or routed experts + shared expert."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}.mlp."
        # Under TP every FFN width is split, so y is this rank's partial sum: one all-reduce covers the
        # routed experts and the shared expert together.
        if not cfg.is_moe_layer(i):
            y = swiglu_mlp(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
            return self.comm.all_reduce(np.ascontiguousarray(y))
        ids, rw = route(x, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"], cfg)
        y = moe_experts(x, ids, rw, *self._experts[i])
        if cfg.n_shared_experts:
            y = y + swiglu_mlp(x, w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"],
                               w[p + "shared_experts.down_proj.weight"])
        return self.comm.all_reduce(np.ascontiguousarray(y))

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, tokens, positions, cache: LatentKVCache, visible=None, capture_layers: Sequence[int] = ()):
        """Run T new tokens. Row i attends every row already in ``cache`` plus new row j where visible[i, j]
        (default causal). Appends the T rows' latent KV to ``cache`` in input order.

        Returns (logits [T, V], feats [T, len(capture_layers), H]) where feats[:, c] is the residual stream
        after layer capture_layers[c] (HF hidden_states[layer + 1]).
        """
        cfg = self.cfg
        tokens = np.asarray(tokens)
        positions = np.asarray(positions)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"forward: tokens must be a non-empty 1-D int array, got {tokens.dtype} {tokens.shape}")
        T = tokens.size
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"forward: tokens must lie in [0, {cfg.vocab_size}), got range "
                             f"[{tokens.min()}, {tokens.max()}]")
        if positions.shape != (T,) or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"forward: positions must be int [{T}], got {positions.dtype} {positions.shape}")
        if positions.min() < 0:
            raise ValueError(f"forward: positions must be >= 0, got min {positions.min()}")
        if not isinstance(cache, LatentKVCache):
            raise ValueError(f"forward: cache must be a LatentKVCache, got {type(cache).__name__}")
        if (cache.num_layers, cache.width, cache.dtype) != (cfg.num_hidden_layers, cfg.kv_cache_dim, self.dtype):
            raise ValueError(f"forward: cache has (layers, width, dtype) = ({cache.num_layers}, {cache.width}, "
                             f"{cache.dtype}), expected ({cfg.num_hidden_layers}, {cfg.kv_cache_dim}, {self.dtype})")
        if visible is None:
            visible = np.tril(np.ones((T, T), bool))
        else:
            visible = np.asarray(visible)
            if visible.shape != (T, T) or visible.dtype != np.bool_:
                raise ValueError(f"forward: visible must be bool [{T}, {T}], got {visible.dtype} {visible.shape}")
            if cache.length == 0 and not visible.any(axis=1).all():
                raise ValueError(f"forward: with an empty cache, visible rows "
                                 f"{np.nonzero(~visible.any(axis=1))[0].tolist()} see nothing")
        capture_layers = tuple(int(c) for c in capture_layers)
        bad = [c for c in capture_layers if not 0 <= c < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"forward: capture_layers {bad} out of range [0, {cfg.num_hidden_layers})")

        h = self.embed(tokens)
        new_rows = []
        feats = np.empty((T, len(capture_layers), cfg.hidden_size), self.dtype)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, rows = self.attention_block(i, rms_norm(h, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                                           positions, cache.layer(i), visible)
            new_rows.append(rows)
            h = h + a
            h = h + self.mlp_block(i, rms_norm(h, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps))
            for c, layer in enumerate(capture_layers):
                if layer == i:
                    feats[:, c] = h
        cache.append(np.stack(new_rows))
        logits = self.project_vocab(rms_norm(h, self.w["model.norm.weight"], cfg.rms_norm_eps))
        return logits, feats
