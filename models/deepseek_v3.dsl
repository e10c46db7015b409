# DeepSeek-V3 (HF DeepseekV3ForCausalLM), and DeepSeek-V2 by config (q_lora_rank=0: plain q_proj;
# V2's rope is interleaved too). Multi-head latent attention: K/V are up-projected per head from a
# kv_lora_rank latent, and only that latent plus one shared rope key (kv_lora_rank + qk_rope_head_dim
# per token) is cached. The MLA absorption pass lets decode attend over the latent directly.
#
# Layer schedule: the first `first_k_dense` layers (HF first_k_dense_replace) use a dense SwiGLU MLP of width
# `ffn` (block `dense`); the other `layers - first_k_dense` use a mixture of `experts` routed SwiGLU experts of
# width `moe_ffn`, top_k per token, plus `shared_experts` always-on experts run as one MLP of width
# moe_ffn * shared_experts (block `moe`). `{i}` in a source is the global layer index, so the moe block's
# layer 0 reads model.layers.{first_k_dense}.
# Router (HF DeepseekV3TopkRouter / DeepseekV2TopkRouter): scores = sigmoid (V3) or softmax (V2) of
# x·w_router; experts are chosen among the best `topk_group` of `n_group` groups (group score: sum of the
# top 2 scores + correction bias (V3), or the max score (V2 group_limited_greedy); n_group = 1 is greedy);
# weights are the chosen scores, renormalised if norm_topk_prob, times routed_scaling.
# HF computes the router matmul in fp32; kiln's runs in the artifact dtype (the same in an fp32 artifact;
# in bf16, near-tied experts may be chosen differently).
# `mscale` is yarn's softmax-scale factor (1.0 without yarn): scale = mscale² / sqrt(nope + rope dim); with
# yarn rope (rope_scaling="yarn", the rope_* args as transformers' rope_parameters) from-hf sets it to
# yarn_get_mscale(factor, mscale_all_dim), as HF DeepseekV3Attention does.
model deepseek_v3(vocab: int, hidden: int, layers: int, heads: int, ffn: int,
                  q_lora_rank: int = 0, kv_lora_rank: int = 512, qk_nope_head_dim: int = 128,
                  qk_rope_head_dim: int = 64, v_head_dim: int = 128, rope_theta: float = 10000.0,
                  rope_interleave: bool = true, mscale: float = 1.0, norm_eps: float = 1e-6,
                  rope_scaling: str = "none", rope_factor: float = 1.0, rope_original_max_position: int = 4096,
                  rope_beta_fast: float = 32.0, rope_beta_slow: float = 1.0, rope_mscale: float = 0.0,
                  rope_mscale_all_dim: float = 0.0, rope_attention_factor: float = 0.0, rope_truncate: bool = true,
                  tie_embeddings: bool = false, max_position: int = 4096, attention_bias: bool = false,
                  first_k_dense: int = layers, experts: int = 0, top_k: int = 1, moe_ffn: int = ffn,
                  shared_experts: int = 0, n_group: int = 1, topk_group: int = 1,
                  routed_scaling: float = 1.0, norm_topk_prob: bool = true, scoring: str = "sigmoid",
                  group_score: str = "top2_sum", correction_bias: bool = true,
                  nextn: int = 0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block dense[first_k_dense] {                  # {i} is the layer index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wq: [heads * (qk_nope_head_dim + qk_rope_head_dim), hidden] from "model.layers.{i}.self_attn.q_proj.weight" if q_lora_rank == 0
    param wq_a: [q_lora_rank, hidden]           from "model.layers.{i}.self_attn.q_a_proj.weight" if q_lora_rank > 0
    param bq_a: [q_lora_rank]                   from "model.layers.{i}.self_attn.q_a_proj.bias" if q_lora_rank > 0 && attention_bias
    param q_a_norm: [q_lora_rank]               from "model.layers.{i}.self_attn.q_a_layernorm.weight" if q_lora_rank > 0
    param wq_b: [heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank] from "model.layers.{i}.self_attn.q_b_proj.weight" if q_lora_rank > 0
    param wkv_a: [kv_lora_rank + qk_rope_head_dim, hidden] from "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"
    param bkv_a: [kv_lora_rank + qk_rope_head_dim] from "model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias" if attention_bias
    param kv_a_norm: [kv_lora_rank]             from "model.layers.{i}.self_attn.kv_a_layernorm.weight"
    param wkv_b: [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] from "model.layers.{i}.self_attn.kv_b_proj.weight"
    param wo: [hidden, heads * v_head_dim]      from "model.layers.{i}.self_attn.o_proj.weight"
    param bo: [hidden]                          from "model.layers.{i}.self_attn.o_proj.bias" if attention_bias
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_gate: [ffn, hidden]                 from "model.layers.{i}.mlp.gate_proj.weight"
    param w_up: [ffn, hidden]                   from "model.layers.{i}.mlp.up_proj.weight"
    param w_down: [hidden, ffn]                 from "model.layers.{i}.mlp.down_proj.weight"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      # q path: low-rank (V3) or direct (V2-Lite); each head is [nope | rope]
      qa = q_lora_rank > 0 ? (attention_bias ? linear(x, wq_a, bq_a) : linear(x, wq_a)) : x
      q = (q_lora_rank > 0 ? linear(rms_norm(qa, q_a_norm, eps=norm_eps), wq_b) : linear(x, wq)) |> view(heads, qk_nope_head_dim + qk_rope_head_dim)
      q_nope = slice(q, start=0, stop=qk_nope_head_dim)
      q_pe = slice(q, start=qk_nope_head_dim, stop=qk_nope_head_dim + qk_rope_head_dim)
      # kv path: one projection to [latent | shared rope key]; only these are cached
      kv = attention_bias ? linear(x, wkv_a, bkv_a) : linear(x, wkv_a)
      c_kv = rms_norm(slice(kv, start=0, stop=kv_lora_rank), kv_a_norm, eps=norm_eps)
      k_pe = slice(kv, start=kv_lora_rank, stop=kv_lora_rank + qk_rope_head_dim) |> view(1, qk_rope_head_dim)
      q_pe = rope_interleave ? deinterleave(q_pe) : q_pe
      k_pe = rope_interleave ? deinterleave(k_pe) : k_pe
      q_pe, k_pe = rope(q_pe, k_pe, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                        original_max_position=rope_original_max_position, beta_fast=rope_beta_fast,
                        beta_slow=rope_beta_slow, mscale=rope_mscale, mscale_all_dim=rope_mscale_all_dim,
                        attention_factor=rope_attention_factor, truncate=rope_truncate)
      a = mla_attention(q_nope, q_pe, c_kv, k_pe, wkv_b,
                        scale=mscale * mscale * (qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
      h = h + (attention_bias ? linear(a, wo, bo) : linear(a, wo))
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      return h + linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)
    }
  }

  # the same attention as `dense` (the DSL has no shared sub-blocks); the MLP is a mixture of experts
  block moe[layers - first_k_dense] {           # {i} is the global layer index, {e} the expert index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight"
    param wq: [heads * (qk_nope_head_dim + qk_rope_head_dim), hidden] from "model.layers.{i}.self_attn.q_proj.weight" if q_lora_rank == 0
    param wq_a: [q_lora_rank, hidden]           from "model.layers.{i}.self_attn.q_a_proj.weight" if q_lora_rank > 0
    param bq_a: [q_lora_rank]                   from "model.layers.{i}.self_attn.q_a_proj.bias" if q_lora_rank > 0 && attention_bias
    param q_a_norm: [q_lora_rank]               from "model.layers.{i}.self_attn.q_a_layernorm.weight" if q_lora_rank > 0
    param wq_b: [heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank] from "model.layers.{i}.self_attn.q_b_proj.weight" if q_lora_rank > 0
    param wkv_a: [kv_lora_rank + qk_rope_head_dim, hidden] from "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"
    param bkv_a: [kv_lora_rank + qk_rope_head_dim] from "model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias" if attention_bias
    param kv_a_norm: [kv_lora_rank]             from "model.layers.{i}.self_attn.kv_a_layernorm.weight"
    param wkv_b: [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] from "model.layers.{i}.self_attn.kv_b_proj.weight"
    param wo: [hidden, heads * v_head_dim]      from "model.layers.{i}.self_attn.o_proj.weight"
    param bo: [hidden]                          from "model.layers.{i}.self_attn.o_proj.bias" if attention_bias
    param mlp_norm: [hidden]                    from "model.layers.{i}.post_attention_layernorm.weight"
    param w_router: [experts, hidden]           from "model.layers.{i}.mlp.gate.weight"
    param router_bias: [experts]                from "model.layers.{i}.mlp.gate.e_score_correction_bias" if correction_bias
    param w_gate: [experts, moe_ffn, hidden]    from "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"
    param w_up: [experts, moe_ffn, hidden]      from "model.layers.{i}.mlp.experts.{e}.up_proj.weight"
    param w_down: [experts, hidden, moe_ffn]    from "model.layers.{i}.mlp.experts.{e}.down_proj.weight"
    param ws_gate: [moe_ffn * shared_experts, hidden] from "model.layers.{i}.mlp.shared_experts.gate_proj.weight" if shared_experts > 0
    param ws_up: [moe_ffn * shared_experts, hidden]   from "model.layers.{i}.mlp.shared_experts.up_proj.weight" if shared_experts > 0
    param ws_down: [hidden, moe_ffn * shared_experts] from "model.layers.{i}.mlp.shared_experts.down_proj.weight" if shared_experts > 0

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      qa = q_lora_rank > 0 ? (attention_bias ? linear(x, wq_a, bq_a) : linear(x, wq_a)) : x
      q = (q_lora_rank > 0 ? linear(rms_norm(qa, q_a_norm, eps=norm_eps), wq_b) : linear(x, wq)) |> view(heads, qk_nope_head_dim + qk_rope_head_dim)
      q_nope = slice(q, start=0, stop=qk_nope_head_dim)
      q_pe = slice(q, start=qk_nope_head_dim, stop=qk_nope_head_dim + qk_rope_head_dim)
      kv = attention_bias ? linear(x, wkv_a, bkv_a) : linear(x, wkv_a)
      c_kv = rms_norm(slice(kv, start=0, stop=kv_lora_rank), kv_a_norm, eps=norm_eps)
      k_pe = slice(kv, start=kv_lora_rank, stop=kv_lora_rank + qk_rope_head_dim) |> view(1, qk_rope_head_dim)
      q_pe = rope_interleave ? deinterleave(q_pe) : q_pe
      k_pe = rope_interleave ? deinterleave(k_pe) : k_pe
      q_pe, k_pe = rope(q_pe, k_pe, theta=rope_theta, scaling=rope_scaling, factor=rope_factor,
                        original_max_position=rope_original_max_position, beta_fast=rope_beta_fast,
                        beta_slow=rope_beta_slow, mscale=rope_mscale, mscale_all_dim=rope_mscale_all_dim,
                        attention_factor=rope_attention_factor, truncate=rope_truncate)
      a = mla_attention(q_nope, q_pe, c_kv, k_pe, wkv_b,
                        scale=mscale * mscale * (qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
      h = h + (attention_bias ? linear(a, wo, bo) : linear(a, wo))
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      router_logits = linear(x, w_router)
      weights, ids = (correction_bias
          ? moe_topk_grouped(router_logits, router_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                             routed_scaling=routed_scaling, renormalize=norm_topk_prob, scoring=scoring,
                             group_score=group_score)
          : moe_topk_grouped(router_logits, top_k=top_k, n_group=n_group, topk_group=topk_group,
                             routed_scaling=routed_scaling, renormalize=norm_topk_prob, scoring=scoring,
                             group_score=group_score))
      routed = moe_experts(x, weights, ids, w_gate, w_up, w_down)
      # HF adds the shared experts to the routed output, then the sum to the residual stream
      return h + (shared_experts > 0 ? routed + linear(silu(linear(x, ws_gate)) * linear(x, ws_up), ws_down) : routed)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  # Multi-token prediction (HF num_nextn_predict_layers; V3 has one module): checkpoint layer `layers` holds a
  # module that predicts token t+2 from the main model's last hidden state h_t (before the final norm) and the
  # embedding of token t+1 — a draft head for speculative decoding. kiln runs the first module (nextn >= 1).
  # Its decoder layer is a MoE layer like the stack's (it follows the first_k_dense dense layers); its
  # embed_tokens / shared_head.head copies are stored once when they equal the main ones.
  param mtp_enorm: [hidden]                     from "model.layers.{layers}.enorm.weight" if nextn > 0
  param mtp_hnorm: [hidden]                     from "model.layers.{layers}.hnorm.weight" if nextn > 0
  param mtp_eh_proj: [hidden, 2 * hidden]       from "model.layers.{layers}.eh_proj.weight" if nextn > 0
  param mtp_embed: [vocab, hidden]              from "model.layers.{layers}.embed_tokens.weight" else "model.embed_tokens.weight" if nextn > 0
  param mtp_norm: [hidden]                      from "model.layers.{layers}.shared_head.norm.weight" if nextn > 0
  param mtp_head: [vocab, hidden]               from "model.layers.{layers}.shared_head.head.weight" else "lm_head.weight" if nextn > 0
  block mtp_layer[1] like moe                   # {i} = layers: the layer after the main stack

  forward(tokens) {
    h = embedding(tokens, embed)
    h = first_k_dense > 0 ? dense(h) : h
    h = first_k_dense < layers ? moe(h) : h
    return logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head), h
  }

  # position t: tokens[t] is token t+1 (the step's tokens shifted by one), h_main[t] the main model's h_t;
  # attention is causal over this layer's own KV cache. Returns the logits of token t+2 and the layer's hidden
  # state, which stands in for h_{t+1} when the head is applied again for drafts 2..k (chained MTP).
  forward mtp(tokens, h_main) if nextn > 0 {
    e = rms_norm(embedding(tokens, mtp_embed), mtp_enorm, eps=norm_eps)
    h = mtp_layer(linear(concat(e, rms_norm(h_main, mtp_hnorm, eps=norm_eps)), mtp_eh_proj))
    return logits(rms_norm(h, mtp_norm, eps=norm_eps), mtp_head), h
  }
}
