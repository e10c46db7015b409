# gpt-oss (HF GptOssForCausalLM, OpenAI's gpt-oss-20b / 120b): GQA attention with q/k/v/o biases and one learned
# sink logit per head (`sinks`: a softmax term that attends to nothing), sliding-window (128) and full layers
# alternating (`sliding_layers`), YaRN rope; every MLP a mixture of experts with a biased router (top-k of the
# logits, softmaxed over the chosen k) and biased experts under a clamped SwiGLU (`activation="clamped_swiglu"`:
# gate/up rows interleaved, gate clamped at `swiglu_limit`, up to ±limit, (up + 1) · gate · sigmoid(alpha · gate)).
# The experts are stored [experts, in, out] (`transposed`), in OpenAI's checkpoints as MXFP4 `*_blocks` +
# `*_scales`, which the weight converter dequantizes to the recipe's dtype.
model gpt_oss(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads, head_dim: int = 64,
              ffn: int, experts: int, top_k: int = 4, rope_theta: float = 150000.0, norm_eps: float = 1e-5,
              tie_embeddings: bool = false, max_position: int = 131072, rope_scaling: str = "none",
              rope_factor: float = 1.0, rope_original_max_position: int = 4096, rope_beta_fast: float = 32.0,
              rope_beta_slow: float = 1.0, rope_mscale: float = 0.0, rope_mscale_all_dim: float = 0.0,
              rope_attention_factor: float = 0.0, rope_truncate: bool = true, sliding_window: int = 128,
              sliding_layers: list, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wq: [heads * head_dim, hidden]        from "model.layers.{i}.self_attn.q_proj.weight"
    param wk: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.k_proj.weight"
    param wv: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.v_proj.weight"
    param wo: [hidden, heads * head_dim]        from "model.layers.{i}.self_attn.o_proj.weight"
    param bq: [heads * head_dim]                from "model.layers.{i}.self_attn.q_proj.bias"
    param bk: [kv_heads * head_dim]             from "model.layers.{i}.self_attn.k_proj.bias"
    param bv: [kv_heads * head_dim]             from "model.layers.{i}.self_attn.v_proj.bias"
    param bo: [hidden]                          from "model.layers.{i}.self_attn.o_proj.bias"
    param sinks: [heads]                        from "model.layers.{i}.self_attn.sinks"
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_router: [experts, hidden]           from "model.layers.{i}.mlp.router.weight"
    param b_router: [experts]                   from "model.layers.{i}.mlp.router.bias"
    param w_gate_up: [experts, 2 * ffn, hidden] from "model.layers.{i}.mlp.experts.gate_up_proj" transposed
    param b_gate_up: [experts, 2 * ffn]         from "model.layers.{i}.mlp.experts.gate_up_proj_bias"
    param w_down: [experts, hidden, ffn]        from "model.layers.{i}.mlp.experts.down_proj" transposed
    param b_down: [experts, hidden]             from "model.layers.{i}.mlp.experts.down_proj_bias"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      q = linear(x, wq, bq) |> view(heads, head_dim)
      k = linear(x, wk, bk) |> view(kv_heads, head_dim)
      v = linear(x, wv, bv) |> view(kv_heads, head_dim)
      q, k = rope(q, k, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                  original_max_position=rope_original_max_position, beta_fast=rope_beta_fast,
                  beta_slow=rope_beta_slow, mscale=rope_mscale, mscale_all_dim=rope_mscale_all_dim,
                  attention_factor=rope_attention_factor, truncate=rope_truncate)
      a = attention(q, k, v, sinks, sliding_window=per_layer(sliding_layers, sliding_window, 0))
      h = h + linear(a, wo, bo)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      # softmax over the top-k logits = the full softmax's top k renormalised (softmax is monotone)
      weights, ids = moe_topk_softmax(linear(x, w_router, b_router), top_k=top_k, renormalize=true)
      return h + moe_experts(x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, activation="clamped_swiglu",
                             alpha=swiglu_alpha, limit=swiglu_limit)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(embedding(tokens, embed))
    return logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
  }
}
