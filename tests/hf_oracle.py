"""Test helper: build HF transformers' DeepseekV3ForCausalLM from a TargetConfig and a reference weight dict,
and run it the ways the reference target is run (prefill, cached decode, tree verification with a 4D mask).

Test-only: imports torch and transformers. Also builds random tiny target weights scaled so activations are O(1).
"""
from __future__ import annotations

import os
from typing import Dict

import numpy as np

from ddtree_cupy.config import TargetConfig
from ddtree_cupy.reference.target import expected_weight_shapes

# Tiny Kimi-K2.6-shaped config (YaRN exactly as K2.6) for oracle tests.
TINY_TARGET = {
    "vocab_size": 1024, "hidden_size": 512, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 1024,
    "moe_intermediate_size": 256, "n_routed_experts": 32, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "max_position_embeddings": 262144,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def tiny_target_config(**overrides) -> TargetConfig:
    d = dict(TINY_TARGET)
    d.update(overrides)
    return TargetConfig.from_dict(d, "<tiny test target>")


def random_target_weights(cfg: TargetConfig, seed: int = 0) -> Dict[str, np.ndarray]:
    """float64 random weights for every tensor the reference needs.

    Linear weights ~ N(0, 1/in) so each projection keeps O(1) activations; norm weights ~ 1 + N(0, 0.1^2) so a
    wrong eps/weight shows; the router bias ~ N(0, 0.02^2) is comparable to the gaps between sigmoid scores,
    so it changes some selections; embeddings ~ N(0, 1).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_weight_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            a = 0.02 * rng.standard_normal(shape)
        elif len(shape) == 1:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = a
    return out


def hf_config(cfg: TargetConfig):
    from transformers import DeepseekV3Config
    d = cfg.to_dict(wrapper=False)
    d.pop("quantization_config", None)
    d["model_type"] = "deepseek_v3"
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    rs = d.pop("rope_scaling") or {}
    rp = {"rope_type": rs.get("type", "default"), "rope_theta": cfg.rope.theta}
    rp.update({k: v for k, v in rs.items() if k != "type"})
    d["rope_parameters"] = rp
    d.pop("rope_theta", None)
    d["rope_interleave"] = True
    c = DeepseekV3Config(**d)
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


def build_hf_model(cfg: TargetConfig, weights: Dict[str, np.ndarray]):
    """DeepseekV3ForCausalLM in float64 holding ``weights`` (per-expert names fused into HF's in-memory
    layout: experts.gate_up_proj [E, 2I, H] = gate rows then up rows, experts.down_proj [E, H, I])."""
    import torch
    from transformers import DeepseekV3ForCausalLM
    from transformers.initialization import no_init_weights
    # skip HF's random init: every parameter is overwritten below (load_state_dict is strict)
    with no_init_weights():
        model = DeepseekV3ForCausalLM(hf_config(cfg)).to(torch.float64).eval()
    sd = model.state_dict()
    new = {}
    for name, a in weights.items():
        if ".mlp.experts." in name:
            continue
        new[name] = torch.from_numpy(np.asarray(a, np.float64))
    for i in cfg.moe_layers:
        p = f"model.layers.{i}.mlp.experts."
        E = cfg.n_routed_experts
        gate = np.stack([weights[f"{p}{e}.gate_proj.weight"] for e in range(E)])
        up = np.stack([weights[f"{p}{e}.up_proj.weight"] for e in range(E)])
        down = np.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(E)])
        new[p + "gate_up_proj"] = torch.from_numpy(np.concatenate([gate, up], axis=1).astype(np.float64))
        new[p + "down_proj"] = torch.from_numpy(down.astype(np.float64))
    missing = sorted(set(sd) - set(new))
    unexpected = sorted(set(new) - set(sd))
    if missing or unexpected:
        raise AssertionError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in new.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise AssertionError(f"HF tensor {k}: shape {tuple(sd[k].shape)} vs ours {tuple(v.shape)}")
    model.load_state_dict(new, strict=True)
    for k, v in model.state_dict().items():
        if v.dtype != torch.float64:
            raise AssertionError(f"HF tensor {k} is {v.dtype}, expected float64")
    return model


def hf_forward(model, tokens, positions, cache=None, visible=None, past_len: int = 0):
    """One HF forward of a single stream. ``visible`` bool [T, T] over the new rows (None: causal), every
    cached row visible. Returns (logits [T, V] float64 numpy, hidden_states tuple of [T, H] numpy, cache)."""
    import torch
    from transformers import DynamicCache
    if cache is None:
        cache = DynamicCache(config=model.config)
    T = len(tokens)
    if visible is None:
        visible = np.tril(np.ones((T, T), bool))
    allowed = np.concatenate([np.ones((T, past_len), bool), np.asarray(visible, bool)], axis=1)
    mask = np.where(allowed, 0.0, -np.inf)[None, None]                     # additive [1, 1, T, past+T]
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens)[None], dtype=torch.long),
                    position_ids=torch.tensor(np.asarray(positions)[None], dtype=torch.long),
                    attention_mask=torch.from_numpy(mask), cache=cache, use_cache=True,
                    output_hidden_states=True)
    hs = tuple(h[0].numpy() for h in out.hidden_states)
    return out.logits[0].numpy(), hs, cache


class _Float64Torch:
    """Stands in for the ``torch`` module inside HF's DeepseekV3 modelling file: every attribute is torch's,
    except that ``torch.float32`` / ``torch.float`` mean float64. HF hard-codes float32 for the RMSNorm math,
    the router logits/sigmoid, the softmax and the RoPE angles; on a float64 model that rounds to float32
    (~1e-7 relative). With this stand-in the same HF code runs in float64 end to end."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        if name in ("float32", "float"):
            return self._torch.float64
        return getattr(self._torch, name)


class float64_exact:
    """Context manager: run ``model`` (built by build_hf_model) in float64 throughout. ``inv_freq`` replaces
    HF's float32 RoPE inverse frequencies (check it against HF's own values separately)."""

    def __init__(self, model, inv_freq: np.ndarray):
        self.model, self.inv_freq = model, inv_freq

    def __enter__(self):
        import torch
        import transformers.models.deepseek_v3.modeling_deepseek_v3 as mod
        self._mod, self._torch = mod, mod.torch
        rot = self.model.model.rotary_emb
        self._old_inv = rot.inv_freq
        rot.inv_freq = torch.from_numpy(np.asarray(self.inv_freq, np.float64))
        mod.torch = _Float64Torch(torch)
        return self.model

    def __exit__(self, *exc):
        self._mod.torch = self._torch
        self.model.model.rotary_emb.inv_freq = self._old_inv
        return False


def hf_cache_rows(cache, layer: int) -> np.ndarray:
    """HF DynamicCache contents of one layer in OUR row layout [S, r + d_rope]: HF stores the normalised c_kv
    as keys and the rotated k_pe as values, the latter de-interleaved (its RoPE writes the rotated even elements
    first, then the odd ones); re-interleave it so rows compare to LatentKVCache rows."""
    c_kv = cache.layers[layer].keys[0, 0].numpy()
    k_hf = cache.layers[layer].values[0, 0].numpy()
    half = k_hf.shape[1] // 2
    k_pe = np.empty_like(k_hf)
    k_pe[:, 0::2], k_pe[:, 1::2] = k_hf[:, :half], k_hf[:, half:]
    return np.concatenate([c_kv, k_pe], axis=1)


def hf_weights_from_checkpoint(model_dir: str, group_size: int = 32) -> Dict[str, np.ndarray]:
    """Read a (tiny) target checkpoint with third-party code only: safetensors' torch reader and
    compressed-tensors' INT4 unpacker. Returns {unprefixed name: float64 array}, routed experts dequantized
    as q * scale (exact in float64), so the HF oracle does not share our checkpoint loader."""
    import glob
    import json

    import torch
    from compressed_tensors.compressors import unpack_from_int32
    from safetensors import safe_open

    raw = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                raw[k] = sf.get_tensor(k)
    with open(os.path.join(model_dir, "config.json")) as fh:
        prefix = "language_model." if "text_config" in json.load(fh) else ""
    out = {}
    for k, v in raw.items():
        if not k.startswith(prefix) or k[len(prefix):].startswith(("vision_tower.", "mm_projector.")):
            continue
        name = k[len(prefix):]
        if name.endswith(".weight_packed"):
            base = name[:-len(".weight_packed")]
            shape = tuple(int(s) for s in raw[prefix + base + ".weight_shape"].tolist())
            q = unpack_from_int32(v, 4, torch.Size(shape)).to(torch.float64)
            scale = raw[prefix + base + ".weight_scale"].to(torch.float64)
            out[base + ".weight"] = (q * scale.repeat_interleave(group_size, dim=1)).numpy()
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        else:
            out[name] = v.to(torch.float64).numpy()
    return out
