# Mixtral (HF MixtralForCausalLM): Llama/Mistral attention with a sparse mixture of SwiGLU experts as the MLP.
# Checkpoints store one tensor per expert (`experts.{e}.w1` = gate, `w3` = up, `w2` = down); `{e}` stacks them
# along dim 0 into [experts, ...] params, and fuse_expert_gate_up merges gate and up per expert.
model mixtral(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads,
              head_dim: int = hidden // heads, ffn: int, experts: int, top_k: int = 2,
              rope_theta: float = 1000000.0, norm_eps: float = 1e-5, tie_embeddings: bool = false,
              max_position: int = 32768, rope_scaling: str = "none", rope_factor: float = 1.0,
              rope_low_freq_factor: float = 1.0, rope_high_freq_factor: float = 4.0,
              rope_original_max_position: int = 8192,
              rope_beta_fast: float = 32.0, rope_beta_slow: float = 1.0, rope_mscale: float = 0.0,
              rope_mscale_all_dim: float = 0.0, rope_attention_factor: float = 0.0, rope_truncate: bool = true,
              sliding_window: int = 0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index, {e} the expert index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wq: [heads * head_dim, hidden]        from "model.layers.{i}.self_attn.q_proj.weight"
    param wk: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.k_proj.weight"
    param wv: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.v_proj.weight"
    param wo: [hidden, heads * head_dim]        from "model.layers.{i}.self_attn.o_proj.weight"
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_router: [experts, hidden]           from "model.layers.{i}.block_sparse_moe.gate.weight"
    param w_gate: [experts, ffn, hidden]        from "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"
    param w_up: [experts, ffn, hidden]          from "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"
    param w_down: [experts, hidden, ffn]        from "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      q = linear(x, wq) |> view(heads, head_dim)
      k = linear(x, wk) |> view(kv_heads, head_dim)
      v = linear(x, wv) |> view(kv_heads, head_dim)
      q, k = rope(q, k, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                  low_freq_factor=rope_low_freq_factor, high_freq_factor=rope_high_freq_factor,
                  original_max_position=rope_original_max_position, beta_fast=rope_beta_fast,
                  beta_slow=rope_beta_slow, mscale=rope_mscale, mscale_all_dim=rope_mscale_all_dim,
                  attention_factor=rope_attention_factor, truncate=rope_truncate)
      a = attention(q, k, v, sliding_window=sliding_window)
      h = h + linear(a, wo)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      weights, ids = moe_topk_softmax(linear(x, w_router), top_k=top_k, renormalize=true)
      return h + moe_experts(x, weights, ids, w_gate, w_up, w_down)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(embedding(tokens, embed))
    return logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
  }
}
