"""Tiny DeepSeek MLA dimensions shared by the MLA tests (as examples/make_tiny_checkpoint.py builds them)."""

# heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
HEADS, NOPE, ROPE, LORA, V_DIM = 4, 16, 8, 32, 16
