"""Model configurations: the Kimi/DeepSeek-V3 target and the DFlash drafter, read from config.json.

Every shape the real checkpoints use is accepted:
  * the K2.5/K2.6 ``kimi_k25`` wrapper (text fields under ``text_config``, tensor names prefixed with
    ``language_model.``) and the plain DeepseekV3 / K2-Thinking config;
  * ``rope_scaling`` with the legacy ``type`` key or ``rope_type``, or HF 5.x ``rope_parameters``
    (which may also carry ``rope_theta``);
  * ``quantization_config`` at top level and/or inside ``text_config`` (both are read; they must agree).

Validation raises ``ConfigError`` with a message that names the field and the file.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence, Tuple


class ConfigError(ValueError):
    """A config.json is missing a field, has an impossible value, or asks for something unsupported."""


# --------------------------------------------------------------------------------------------------
# helpers

# The largest value any integer field may take: every size is used in int32 index arithmetic on the GPU.
INT32_MAX = 2 ** 31 - 1


def _type_name(kind) -> str:
    return {int: "an integer", float: "a finite number", bool: "a boolean (true/false)", str: "a string"}.get(
        kind, getattr(kind, "__name__", str(kind)))


def _coerce(v: Any, kind, key: str, where: str):
    """``v`` checked to be ``kind``: ints are ints (not booleans, not strings), floats are finite numbers
    (ints accepted), booleans are JSON booleans (the string "false" is not False)."""
    bad = ConfigError(f"{where}: field '{key}' must be {_type_name(kind)}, got {v!r}")
    if kind is int:
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad
        if abs(v) > INT32_MAX:
            raise ConfigError(f"{where}: field '{key}' = {v} is out of range (|value| <= {INT32_MAX})")
        return v
    if kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad
        v = float(v)
        if not math.isfinite(v):
            raise bad
        return v
    if kind is bool or kind is str:
        if not isinstance(v, kind):
            raise bad
        return v
    if not isinstance(v, kind):
        raise bad
    return v


def _get(d: Mapping[str, Any], key: str, where: str, default: Any = ..., kind: type | tuple = None):
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing required field '{key}'")
        return default
    v = d[key]
    return v if kind is None else _coerce(v, kind, key, where)


def _mapping(v: Any, key: str, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: field '{key}' must be an object, got {type(v).__name__} {_short(v)}")
    return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _positive(where: str, **fields):
    for k, v in fields.items():
        # "not v > 0" also refuses NaN (for which v <= 0 is False)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == math.inf:
            raise ConfigError(f"{where}: field '{k}' must be positive and finite, got {v!r}")


def _at_least(where: str, lo: float, **fields):
    for k, v in fields.items():
        if v is None or not v >= lo or v == math.inf:
            raise ConfigError(f"{where}: field '{k}' must be finite and >= {lo}, got {v!r}")


def _at_most(where: str, hi: float, **fields):
    """Upper bounds far beyond any real model's value: a number above them is a corrupted file."""
    for k, v in fields.items():
        if v is not None and v > hi:
            raise ConfigError(f"{where}: field '{k}' = {v!r} is out of range (at most {hi:g})")


def _token_ids(v: Any, key: str, where: str, vocab_size: int, in_vocab: bool) -> Any:
    """A token-id field: None, an int, or (HF allows it) a non-empty list of ints. Returns None, an int or a
    tuple of ints. ``in_vocab``: every id must be a row of the vocabulary."""
    if v is None:
        return None
    ids = list(v) if isinstance(v, (list, tuple)) else [v]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: field '{key}' must be a token id or a non-empty list of token ids, got {_short(v)}")
    hi = vocab_size if in_vocab else INT32_MAX + 1
    bad = [i for i in ids if not 0 <= i < hi]
    if bad:
        raise ConfigError(f"{where}: field '{key}' has id(s) {bad} outside the vocabulary [0, {vocab_size})"
                          if in_vocab else f"{where}: field '{key}' has negative or too large id(s) {bad}")
    return tuple(ids) if isinstance(v, (list, tuple)) else ids[0]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude factor: 0.1 * m * ln(s) + 1 for s > 1, else 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# --------------------------------------------------------------------------------------------------
# RoPE

@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters. ``kind`` is 'yarn' or 'default' (plain RoPE)."""
    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str) -> "RopeConfig":
        key = "rope_scaling" if d.get("rope_scaling") is not None else "rope_parameters"
        scaling = d.get(key)
        scaling = {} if scaling is None else _mapping(scaling, key, where)
        src = d if d.get("rope_theta") is not None else scaling
        theta = _get(src, "rope_theta", where if src is d else f"{where}: {key}", kind=float)
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if kind not in ("yarn", "default"):
            raise ConfigError(f"{where}: unsupported rope type {_short(kind)} (supported: 'yarn', 'default')")
        if kind == "default":
            rc = RopeConfig(theta=theta)
        else:
            rs = f"{where}: {key}"
            f = lambda k, *a: _get(scaling, k, rs, *a, kind=float)   # noqa: E731
            rc = RopeConfig(
                theta=theta,
                kind="yarn",
                factor=f("factor"),
                original_max_position_embeddings=_get(scaling, "original_max_position_embeddings", rs, kind=int),
                beta_fast=f("beta_fast", 32.0),
                beta_slow=f("beta_slow", 1.0),
                mscale=f("mscale", 1.0),
                mscale_all_dim=f("mscale_all_dim", 0.0),
            )
            _at_least(rs, 0.0, mscale=rc.mscale, mscale_all_dim=rc.mscale_all_dim, beta_slow=rc.beta_slow)
        _positive(where, rope_theta=rc.theta, factor=rc.factor,
                  original_max_position_embeddings=rc.original_max_position_embeddings)
        _at_most(where, 1e12, rope_theta=rc.theta)
        _at_most(where, 1e6, factor=rc.factor, beta_fast=rc.beta_fast, mscale=rc.mscale,
                 mscale_all_dim=rc.mscale_all_dim)
        if rc.kind == "yarn" and rc.beta_fast < rc.beta_slow:
            raise ConfigError(f"{where}: rope_scaling beta_fast ({rc.beta_fast}) < beta_slow ({rc.beta_slow})")
        return rc

    def to_dict(self) -> dict:
        if self.kind == "default":
            return {}
        return {"type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim}

    @property
    def amplitude(self) -> float:
        """cos/sin amplitude factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for Kimi)."""
        if self.kind != "yarn":
            return 1.0
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


# --------------------------------------------------------------------------------------------------
# quantization

@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized W4A16, symmetric, grouped (the only scheme the engine runs)."""
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    ignore: Tuple[str, ...] = ()

    @staticmethod
    def from_dict(q: Mapping[str, Any], where: str) -> "QuantConfig":
        w = f"{where}: quantization_config"
        q = _mapping(q, "quantization_config", where)
        method = q.get("quant_method")
        if method != "compressed-tensors":
            raise ConfigError(f"{w}: unsupported quant_method {_short(method)} (only 'compressed-tensors')")
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise ConfigError(f"{w}: unsupported format {_short(fmt)} (only 'pack-quantized')")
        groups = _mapping(q.get("config_groups") or {}, "config_groups", w)
        if len(groups) != 1:
            raise ConfigError(f"{w}: expected exactly one config group, got {len(groups)}")
        (gname, group), = groups.items()
        group = _mapping(group or {}, f"config_groups.{gname}", w)
        wts = group.get("weights")
        if not wts:
            raise ConfigError(f"{w}: config group {gname!r} has no 'weights' scheme")
        wts = _mapping(wts, f"config_groups.{gname}.weights", w)
        if group.get("input_activations") is not None:
            raise ConfigError(f"{w}: quantized input activations are unsupported (W4A16 only)")
        ignore = q.get("ignore") or ()
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(x, str) for x in ignore):
            raise ConfigError(f"{w}: field 'ignore' must be a list of strings, got {_short(ignore)}")
        bits, gs = wts.get("num_bits"), wts.get("group_size")
        if bits != 4 or isinstance(bits, bool):
            raise ConfigError(f"{w}: unsupported num_bits {bits!r} (only 4)")
        if wts.get("type", "int") != "int":
            raise ConfigError(f"{w}: unsupported weight type {wts.get('type')!r} (only 'int')")
        if wts.get("symmetric", False) is not True:
            raise ConfigError(f"{w}: asymmetric quantization is unsupported")
        if wts.get("strategy") != "group":
            raise ConfigError(f"{w}: unsupported strategy {wts.get('strategy')!r} (only 'group')")
        if gs != 32 or isinstance(gs, bool):
            raise ConfigError(f"{w}: unsupported group_size {gs!r} (kernels are built for 32)")
        if wts.get("actorder") not in (None, False):
            raise ConfigError(f"{w}: activation reordering (actorder) is unsupported")
        return QuantConfig(num_bits=4, group_size=32, symmetric=True, ignore=tuple(ignore))

    def to_dict(self) -> dict:
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": self.num_bits, "type": "int", "symmetric": self.symmetric,
                            "strategy": "group", "group_size": self.group_size, "dynamic": False,
                            "actorder": None, "block_structure": None, "observer": "minmax",
                            "observer_kwargs": {}}}},
            "ignore": list(self.ignore),
        }


# --------------------------------------------------------------------------------------------------
# target

@dataclass(frozen=True)
class TargetConfig:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int            # layer-0 (dense) MLP width
    moe_intermediate_size: int        # routed and shared expert width
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rope: RopeConfig
    max_position_embeddings: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    rms_norm_eps: float
    # eps of q_a_layernorm / kv_a_layernorm. HF transformers uses 1e-6, vLLM/SGLang use rms_norm_eps;
    # we follow HF (the oracle we test against); the difference is far below bf16 resolution.
    latent_norm_eps: float = 1e-6
    bos_token_id: Optional[int] = None
    # an id, or (as HF allows) a tuple of ids that all end generation
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    quant: Optional[QuantConfig] = None
    # "language_model." for the K2.5/K2.6 wrapper, "" for plain DeepseekV3 checkpoints.
    weight_prefix: str = ""
    model_type: str = "kimi_k2"
    source: str = "<dict>"

    # ---- derived ------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        """Every end-of-sequence id config.json names (none, one, or HF's list)."""
        e = self.eos_token_id
        return () if e is None else tuple(int(i) for i in e) if isinstance(e, (tuple, list)) else (int(e),)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the normalised latent plus the rotated k_pe (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        s = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn":
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            s = s * m * m
        return s

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def moe_layers(self) -> Tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def is_quantized(self, name: str) -> bool:
        """Whether the linear ``name`` (unprefixed) is stored INT4. Only routed experts are, in Kimi."""
        return self.quant is not None and ".mlp.experts." in name

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> "TargetConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: config must be a JSON object")
        where = source
        prefix = ""
        d = raw
        if "text_config" in raw:
            d = raw["text_config"]
            if not isinstance(d, Mapping):
                raise ConfigError(f"{source}: 'text_config' must be an object")
            where = f"{source} (text_config)"
            prefix = "language_model."
        quant = None
        qdicts = [q for q in (raw.get("quantization_config"), d.get("quantization_config") if d is not raw else None)
                  if q is not None]
        if qdicts:
            parsed = [QuantConfig.from_dict(q, where) for q in qdicts]
            if len(parsed) == 2 and (parsed[0].num_bits, parsed[0].group_size) != (parsed[1].num_bits, parsed[1].group_size):
                raise ConfigError(f"{where}: top-level and text_config quantization_config disagree")
            quant = parsed[-1]
        g = lambda k, *a, **kw: _get(d, k, where, *a, **kw)
        vocab = g("vocab_size", kind=int)

        def tid(key, in_vocab):      # token ids: in text_config, else at top level (HF allows a list for eos)
            src = d if d.get(key) is not None else raw
            return _token_ids(src.get(key), key, where if src is d else source, vocab, in_vocab)
        n_routed = g("n_routed_experts", 0, kind=int)
        cfg = TargetConfig(
            num_hidden_layers=g("num_hidden_layers", kind=int),
            hidden_size=g("hidden_size", kind=int),
            intermediate_size=g("intermediate_size", kind=int),
            moe_intermediate_size=g("moe_intermediate_size", 0 if not n_routed else ..., kind=int),
            n_routed_experts=n_routed,
            num_experts_per_tok=g("num_experts_per_tok", 0 if not n_routed else ..., kind=int),
            n_shared_experts=g("n_shared_experts", 0, kind=int),
            first_k_dense_replace=g("first_k_dense_replace", 0, kind=int),
            moe_layer_freq=g("moe_layer_freq", 1, kind=int),
            num_attention_heads=g("num_attention_heads", kind=int),
            q_lora_rank=g("q_lora_rank", kind=int),
            kv_lora_rank=g("kv_lora_rank", kind=int),
            qk_nope_head_dim=g("qk_nope_head_dim", kind=int),
            qk_rope_head_dim=g("qk_rope_head_dim", kind=int),
            v_head_dim=g("v_head_dim", kind=int),
            vocab_size=vocab,
            rope=RopeConfig.from_dict(d, where),
            max_position_embeddings=g("max_position_embeddings", kind=int),
            routed_scaling_factor=g("routed_scaling_factor", 1.0, kind=float),
            scoring_func=g("scoring_func", "sigmoid", kind=str),
            topk_method=g("topk_method", "noaux_tc", kind=str),
            n_group=g("n_group", 1, kind=int),
            topk_group=g("topk_group", 1, kind=int),
            norm_topk_prob=g("norm_topk_prob", True, kind=bool),
            rms_norm_eps=g("rms_norm_eps", 1e-6, kind=float),
            bos_token_id=tid("bos_token_id", False),
            eos_token_id=tid("eos_token_id", True),
            pad_token_id=tid("pad_token_id", False),
            quant=quant,
            weight_prefix=prefix,
            model_type=g("model_type", "deepseek_v3", kind=str),
            source=source,
        )
        cfg.validate()
        return cfg

    @staticmethod
    def load(path: str) -> "TargetConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        return TargetConfig.from_dict(_read_json(path), _config_path(path))

    def validate(self) -> None:
        w = self.source
        _positive(w, num_hidden_layers=self.num_hidden_layers, hidden_size=self.hidden_size,
                  intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
                  q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                  qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                  v_head_dim=self.v_head_dim, vocab_size=self.vocab_size,
                  max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                  moe_layer_freq=self.moe_layer_freq, routed_scaling_factor=self.routed_scaling_factor,
                  latent_norm_eps=self.latent_norm_eps)
        _at_most(w, 1.0, rms_norm_eps=self.rms_norm_eps, latent_norm_eps=self.latent_norm_eps)
        _at_most(w, 1e6, routed_scaling_factor=self.routed_scaling_factor)
        _at_least(w, 0, n_shared_experts=self.n_shared_experts, first_k_dense_replace=self.first_k_dense_replace,
                  n_routed_experts=self.n_routed_experts)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{w}: qk_rope_head_dim must be even for RoPE pairs, got {self.qk_rope_head_dim}")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"{w}: unsupported scoring_func {self.scoring_func!r} (only 'sigmoid')")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"{w}: unsupported topk_method {self.topk_method!r} (only 'noaux_tc')")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"{w}: first_k_dense_replace ({self.first_k_dense_replace}) exceeds "
                              f"num_hidden_layers ({self.num_hidden_layers})")
        if self.n_routed_experts:
            _positive(w, moe_intermediate_size=self.moe_intermediate_size,
                      num_experts_per_tok=self.num_experts_per_tok, n_group=self.n_group,
                      topk_group=self.topk_group)
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(f"{w}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"n_routed_experts ({self.n_routed_experts})")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"{w}: n_routed_experts ({self.n_routed_experts}) not divisible by "
                                  f"n_group ({self.n_group})")
            if self.topk_group > self.n_group:
                raise ConfigError(f"{w}: topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(f"{w}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts "
                                  f"in topk_group groups ({self.topk_group * per_group})")
        if self.quant is not None and self.n_routed_experts:
            for name, k in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if k % self.quant.group_size:
                    raise ConfigError(f"{w}: {name} ({k}) not divisible by the INT4 group size {self.quant.group_size}")

    def validate_tp(self, tp: int) -> None:
        """Raise unless every tensor-parallel split of the plan divides evenly by ``tp``."""
        if tp < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {tp}")
        checks = [("num_attention_heads", self.num_attention_heads),
                  ("intermediate_size", self.intermediate_size),
                  ("vocab_size", self.vocab_size)]
        if self.n_routed_experts:
            checks.append(("moe_intermediate_size", self.moe_intermediate_size))
        for name, v in checks:
            if v % tp:
                raise ConfigError(f"{self.source}: {name} ({v}) is not divisible by the tensor-parallel size {tp}")
        if self.quant is not None and self.n_routed_experts and (self.moe_intermediate_size // tp) % self.quant.group_size:
            raise ConfigError(f"{self.source}: moe_intermediate_size / tp ({self.moe_intermediate_size // tp}) is not "
                              f"a multiple of the INT4 group size {self.quant.group_size} (down_proj K shard)")

    def to_dict(self, wrapper: bool = True) -> dict:
        """config.json contents; ``wrapper`` writes the K2.5/K2.6 kimi_k25 shape."""
        text = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts, "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab_size, "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.to_dict() or None,
            "max_position_embeddings": self.max_position_embeddings,
            "routed_scaling_factor": self.routed_scaling_factor, "scoring_func": self.scoring_func,
            "topk_method": self.topk_method, "n_group": self.n_group, "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": "bfloat16",
        }
        if not wrapper:
            if self.quant is not None:
                text["quantization_config"] = self.quant.to_dict()
            return text
        out = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text}
        if self.quant is not None:
            out["quantization_config"] = self.quant.to_dict()
            text["quantization_config"] = self.quant.to_dict()
        return out


# --------------------------------------------------------------------------------------------------
# drafter

@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    block_size: int
    target_layer_ids: Tuple[int, ...]
    mask_token_id: int
    num_target_layers: Optional[int] = None
    max_position_embeddings: int = 262144
    # RoPE cos/sin amplitude. None: the config's YaRN amplitude (1.0 for Kimi). A public integration found
    # 1 + 0.1 ln(factor) (= 1.4159 for factor 64) drafts better: pass that explicitly to use it.
    rope_amplitude: Optional[float] = None
    # Keep only the last ``draft_window`` context tokens visible to the drafter (None: all).
    draft_window: Optional[int] = None
    source: str = "<dict>"

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def effective_rope_amplitude(self) -> float:
        return self.rope.amplitude if self.rope_amplitude is None else self.rope_amplitude

    @staticmethod
    def from_dict(d: Mapping[str, Any], source: str = "<dict>") -> "DrafterConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: config must be a JSON object")
        g = lambda k, *a, **kw: _get(d, k, source, *a, **kw)
        dfl = d.get("dflash_config")
        if not isinstance(dfl, Mapping):
            raise ConfigError(f"{source}: missing required object 'dflash_config' (is this a DFlash drafter?)")
        ids = dfl.get("target_layer_ids")
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT32_MAX for i in ids)):
            raise ConfigError(f"{source}: dflash_config.target_layer_ids must be a non-empty list of non-negative "
                              f"ints, got {_short(ids)}")
        mask_src = dfl if dfl.get("mask_token_id") is not None else d
        if mask_src.get("mask_token_id") is None:
            raise ConfigError(f"{source}: missing required field 'dflash_config.mask_token_id'")
        mask = _get(mask_src, "mask_token_id", source + (": dflash_config" if mask_src is dfl else ""), kind=int)
        bs_src = dfl if dfl.get("block_size") is not None else d
        block_size = _get(bs_src, "block_size", source + (": dflash_config" if bs_src is dfl else ""), 0, kind=int)
        heads = g("num_attention_heads", kind=int)
        hidden = g("hidden_size", kind=int)
        cfg = DrafterConfig(
            hidden_size=hidden,
            intermediate_size=g("intermediate_size", kind=int),
            num_hidden_layers=g("num_hidden_layers", kind=int),
            num_attention_heads=heads,
            num_key_value_heads=g("num_key_value_heads", heads, kind=int),
            head_dim=g("head_dim", hidden // heads if heads else 0, kind=int),
            vocab_size=g("vocab_size", kind=int),
            rms_norm_eps=g("rms_norm_eps", 1e-6, kind=float),
            rope=RopeConfig.from_dict(d, source),
            block_size=block_size,
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=mask,
            num_target_layers=g("num_target_layers", None, kind=int),
            max_position_embeddings=g("max_position_embeddings", 262144, kind=int),
            source=source,
        )
        cfg.validate()
        return cfg

    @staticmethod
    def load(path: str) -> "DrafterConfig":
        return DrafterConfig.from_dict(_read_json(path), _config_path(path))

    def validate(self) -> None:
        w = self.source
        _positive(w, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                  num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                  vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                  max_position_embeddings=self.max_position_embeddings)
        _at_most(w, 1.0, rms_norm_eps=self.rms_norm_eps)
        if self.num_target_layers is not None:
            _positive(w, num_target_layers=self.num_target_layers)
        if self.rope_amplitude is not None:
            _positive(w, rope_amplitude=self.rope_amplitude)
        if self.block_size < 2:
            raise ConfigError(f"{w}: block_size must be >= 2 (one bonus token plus at least one draft), "
                              f"got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{w}: num_attention_heads ({self.num_attention_heads}) not divisible by "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{w}: head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"{w}: mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"{w}: dflash_config.target_layer_ids has duplicates: {list(self.target_layer_ids)}")
        if self.draft_window is not None and self.draft_window < 1:
            raise ConfigError(f"{w}: draft_window must be >= 1, got {self.draft_window}")

    def check_matches(self, target: TargetConfig) -> None:
        """Raise unless this drafter can run on ``target`` (shared embedding/lm_head, feature layers)."""
        w = f"drafter {self.source} vs target {target.source}"
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"{w}: hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"{w}: vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"{w}: target_layer_ids {bad} out of range for a target with "
                              f"{target.num_hidden_layers} layers")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            raise ConfigError(f"{w}: num_target_layers {self.num_target_layers} != target num_hidden_layers "
                              f"{target.num_hidden_layers}")

    def validate_tp(self, tp: int) -> None:
        if tp < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {tp}")
        for name, v in (("num_attention_heads", self.num_attention_heads),
                        ("num_key_value_heads", self.num_key_value_heads),
                        ("intermediate_size", self.intermediate_size)):
            if v % tp:
                raise ConfigError(f"{self.source}: {name} ({v}) is not divisible by the tensor-parallel size {tp}")

    def with_options(self, rope_amplitude: Optional[float] = None, draft_window: Optional[int] = None) -> "DrafterConfig":
        cfg = replace(self, rope_amplitude=rope_amplitude, draft_window=draft_window)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "num_target_layers": self.num_target_layers,
            "block_size": self.block_size, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta, "rope_scaling": ({"rope_type": "yarn", **{k: v for k, v in self.rope.to_dict().items() if k != "type"}}
                                                             if self.rope.kind == "yarn" else None),
            "rms_norm_eps": self.rms_norm_eps,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        }


# --------------------------------------------------------------------------------------------------

def _config_path(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _read_json(path: str) -> dict:
    p = _config_path(path)
    if not os.path.exists(p):
        raise ConfigError(f"{p}: config.json not found" + ("" if os.path.isdir(os.path.dirname(p) or ".")
                                                           else f" (directory {os.path.dirname(p)} does not exist)"))
    try:
        with open(p) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: malformed JSON: {e}") from None
