"""The small generated-checkpoint shapes the CPU tests share (``tinymodel.TinySpec``; the demo's own spec is the
package default)."""
from dataclasses import replace

from ddtree_cupy.tinymodel import TinySpec

# two layers, three shards: the checkpoint-format tests (copied and damaged many times); K a multiple of 32
MICRO = TinySpec(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=64,
                 moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, num_shards=3,
                 drafter_hidden_layers=1, drafter_attention_heads=2, drafter_kv_heads=1, drafter_head_dim=32,
                 drafter_intermediate_size=64, drafter_target_layer_ids=(0, 1))

# three layers (one dense, two MoE), 128 positions: the CLI and decode-loop tests
SMALL = TinySpec(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, num_shards=2,
                 drafter_hidden_layers=1, drafter_attention_heads=4, drafter_kv_heads=2, drafter_head_dim=16,
                 drafter_intermediate_size=128, drafter_target_layer_ids=(0, 1, 2), max_position_embeddings=128)

SMALL_256 = replace(SMALL, max_position_embeddings=256)
