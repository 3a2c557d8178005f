"""Plain numpy references that the GPU code is tested against."""
from .mla import latent_attention, mla_attention_absorbed, mla_attention_naive, split_kv_b
from .moe import moe_experts, route, silu, swiglu_mlp
from .norm import rms_norm
from .rope import apply_rope_adjacent, apply_rope_rotate_half, yarn_inv_freq
from .target import LatentKVCache, ReferenceTarget, expected_weight_shapes

__all__ = [
    "rms_norm", "yarn_inv_freq", "apply_rope_adjacent", "apply_rope_rotate_half",
    "route", "moe_experts", "swiglu_mlp", "silu",
    "split_kv_b", "latent_attention", "mla_attention_absorbed", "mla_attention_naive",
    "LatentKVCache", "ReferenceTarget", "expected_weight_shapes",
]
