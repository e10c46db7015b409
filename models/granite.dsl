# IBM Granite 3.x (HF GraniteForCausalLM): Llama with four scalars of its config — the embeddings times
# embedding_multiplier, each residual branch (the attention's and the MLP's output) times residual_multiplier
# before it is added, attention scores scaled by attention_multiplier (instead of head_dim ** -0.5), and the
# logits divided by logits_scaling.
model granite(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads,
            head_dim: int = hidden // heads, ffn: int, rope_theta: float = 10000.0,
            norm_eps: float = 1e-5, tie_embeddings: bool = true, max_position: int = 4096,
            rope_scaling: str = "none", rope_factor: float = 1.0, rope_low_freq_factor: float = 1.0,
            rope_high_freq_factor: float = 4.0, rope_original_max_position: int = 8192,
            rope_beta_fast: float = 32.0, rope_beta_slow: float = 1.0, rope_mscale: float = 0.0,
            rope_mscale_all_dim: float = 0.0, rope_attention_factor: float = 0.0, rope_truncate: bool = true,
            attention_bias: bool = false, mlp_bias: bool = false, embedding_multiplier: float = 1.0,
            residual_multiplier: float = 1.0, attention_multiplier: float = 1.0, logits_scaling: float = 1.0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wq: [heads * head_dim, hidden]        from "model.layers.{i}.self_attn.q_proj.weight"
    param wk: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.k_proj.weight"
    param wv: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.v_proj.weight"
    param wo: [hidden, heads * head_dim]        from "model.layers.{i}.self_attn.o_proj.weight"
    param bq: [heads * head_dim]                from "model.layers.{i}.self_attn.q_proj.bias" if attention_bias
    param bk: [kv_heads * head_dim]             from "model.layers.{i}.self_attn.k_proj.bias" if attention_bias
    param bv: [kv_heads * head_dim]             from "model.layers.{i}.self_attn.v_proj.bias" if attention_bias
    param bo: [hidden]                          from "model.layers.{i}.self_attn.o_proj.bias" if attention_bias
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_gate: [ffn, hidden]                 from "model.layers.{i}.mlp.gate_proj.weight"
    param w_up: [ffn, hidden]                   from "model.layers.{i}.mlp.up_proj.weight"
    param w_down: [hidden, ffn]                 from "model.layers.{i}.mlp.down_proj.weight"
    param b_gate: [ffn]                         from "model.layers.{i}.mlp.gate_proj.bias" if mlp_bias
    param b_up: [ffn]                           from "model.layers.{i}.mlp.up_proj.bias" if mlp_bias
    param b_down: [hidden]                      from "model.layers.{i}.mlp.down_proj.bias" if mlp_bias

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      q = (attention_bias ? linear(x, wq, bq) : linear(x, wq)) |> view(heads, head_dim)
      k = (attention_bias ? linear(x, wk, bk) : linear(x, wk)) |> view(kv_heads, head_dim)
      v = (attention_bias ? linear(x, wv, bv) : linear(x, wv)) |> view(kv_heads, head_dim)
      q, k = rope(q, k, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                  low_freq_factor=rope_low_freq_factor, high_freq_factor=rope_high_freq_factor,
                  original_max_position=rope_original_max_position, beta_fast=rope_beta_fast,
                  beta_slow=rope_beta_slow, mscale=rope_mscale, mscale_all_dim=rope_mscale_all_dim,
                  attention_factor=rope_attention_factor, truncate=rope_truncate)
      a = attention(q, k, v, scale=attention_multiplier)
      h = h + scale(attention_bias ? linear(a, wo, bo) : linear(a, wo), factor=residual_multiplier)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      gate = mlp_bias ? linear(x, w_gate, b_gate) : linear(x, w_gate)
      up = mlp_bias ? linear(x, w_up, b_up) : linear(x, w_up)
      y = mlp_bias ? linear(silu(gate) * up, w_down, b_down) : linear(silu(gate) * up, w_down)
      return h + scale(y, factor=residual_multiplier)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(scale(embedding(tokens, embed), factor=embedding_multiplier))
    y = logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
    return scale(y, factor=1.0 / logits_scaling), h  # h: what a draft head reads
  }
}
