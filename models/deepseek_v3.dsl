# DeepSeek-V3 (HF DeepseekV3ForCausalLM), and DeepSeek-V2 by config (q_lora_rank=0: plain q_proj;
# V2's rope is interleaved too). Multi-head latent attention: K/V are up-projected per head from a
# kv_lora_rank latent, and only that latent plus one shared rope key (kv_lora_rank + qk_rope_head_dim
# per token) is cached. The MLA absorption pass lets decode attend over the latent directly.
# `first_k_dense` layers use a dense SwiGLU MLP; mixture-of-experts layers are not in this model yet, so
# `first_k_dense` must equal `layers` (`kiln recipe from-hf` refuses checkpoints with MoE layers).
# `mscale` is yarn's softmax-scale factor (1.0 without yarn): scale = mscale² / sqrt(nope + rope dim).
model deepseek_v3(vocab: int, hidden: int, layers: int, heads: int, ffn: int,
                  q_lora_rank: int = 0, kv_lora_rank: int = 512, qk_nope_head_dim: int = 128,
                  qk_rope_head_dim: int = 64, v_head_dim: int = 128, rope_theta: float = 10000.0,
                  rope_interleave: bool = true, mscale: float = 1.0, norm_eps: float = 1e-6,
                  tie_embeddings: bool = false, max_position: int = 4096, attention_bias: bool = false,
                  first_k_dense: int = layers) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[first_k_dense] {                # {i} is the layer index
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
      q_pe, k_pe = rope(q_pe, k_pe, theta=rope_theta)
      a = mla_attention(q_nope, q_pe, c_kv, k_pe, wkv_b,
                        scale=mscale * mscale * (qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
      h = h + (attention_bias ? linear(a, wo, bo) : linear(a, wo))
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      return h + linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)
    }
  }

  param norm: [hidden]                          from "model.norm.weight"
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(embedding(tokens, embed))
    return logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
  }
}
