# Phi-3 / Phi-3.5 / Phi-4-mini (HF Phi3ForCausalLM tensor names): q/k/v stored as one `qkv_proj` and gate/up as
# one `gate_up_proj` in the checkpoint; otherwise a Llama decoder (RMSNorm, SwiGLU, GQA, optional sliding window).
# Phi-3-*-128k, Phi-3.5 and Phi-4-mini scale their rope with LongRoPE (rope_scaling = "longrope": one divisor per
# rotated frequency, the short set or the long one, chosen by the longest context the artifact serves: docs/rope.md);
# Phi-4-mini rotates only the first rope_rotary_dim dims of each head (partial_rotary_factor 0.75; 0 = all).
model phi3(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads,
           head_dim: int = hidden // heads, ffn: int, rope_theta: float = 10000.0,
           norm_eps: float = 1e-5, tie_embeddings: bool = false, max_position: int = 4096,
           rope_scaling: str = "none", rope_factor: float = 1.0, rope_original_max_position: int = 4096,
           rope_attention_factor: float = 0.0, rope_short_factor: list = [], rope_long_factor: list = [],
           rope_rotary_dim: int = 0, sliding_window: int = 0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wqkv: [(heads + 2 * kv_heads) * head_dim, hidden] from "model.layers.{i}.self_attn.qkv_proj.weight"
    param wo: [hidden, heads * head_dim]        from "model.layers.{i}.self_attn.o_proj.weight"
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_gate_up: [2 * ffn, hidden]          from "model.layers.{i}.mlp.gate_up_proj.weight"
    param w_down: [hidden, ffn]                 from "model.layers.{i}.mlp.down_proj.weight"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      qkv = linear(x, wqkv)
      q = slice(qkv, start=0, stop=heads * head_dim) |> view(heads, head_dim)
      k = slice(qkv, start=heads * head_dim, stop=(heads + kv_heads) * head_dim) |> view(kv_heads, head_dim)
      v = slice(qkv, start=(heads + kv_heads) * head_dim, stop=(heads + 2 * kv_heads) * head_dim) |> view(kv_heads, head_dim)
      q, k = rope(q, k, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                  original_max_position=rope_original_max_position, attention_factor=rope_attention_factor,
                  short_factor=rope_short_factor, long_factor=rope_long_factor, rotary_dim=rope_rotary_dim)
      a = attention(q, k, v, sliding_window=sliding_window)
      h = h + linear(a, wo)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      gate_up = linear(x, w_gate_up)
      gate = slice(gate_up, start=0, stop=ffn)
      up = slice(gate_up, start=ffn, stop=2 * ffn)
      return h + linear(silu(gate) * up, w_down)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(embedding(tokens, embed))
    return logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head), h
  }
}
