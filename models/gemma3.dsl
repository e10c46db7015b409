# Gemma 3 text (HF Gemma3ForCausalLM; the language model of Gemma3ForConditionalGeneration with
# prefix="model.language_model." or "language_model.model."): embeddings times sqrt(hidden); RMSNorm scaling
# by 1 + w (the 1 is added to every norm weight at conversion: `+ 1.0`); sandwich norms (the outputs of
# attention and MLP are normed before each residual add); q/k norms per head; GELU (tanh) gated MLP; scores
# scaled by query_pre_attn_scalar ** -0.5. Layers where `sliding_layers` is true (5 of every 6 in Google's
# checkpoints) attend over the last `sliding_window` positions with rope base `rope_local_theta`; the others
# attend globally with `rope_theta` and its scaling (linear, factor 8, on the 4B and larger).
# Numerics: 1 + w is added in fp32 at conversion, exact in an fp32 artifact; a bf16 artifact stores it rounded to
# bf16 (HF forms 1 + w in fp32 at every call): a bf16-rounding difference, not validated against HF in bf16 yet.
# Every layer keeps a full-length KV cache (sliding layers do not yet free blocks behind their window).
model gemma3(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads,
             head_dim: int = hidden // heads, ffn: int, rope_theta: float = 1000000.0,
             rope_local_theta: float = 10000.0, rope_scaling: str = "none", rope_factor: float = 1.0,
             norm_eps: float = 1e-6, tie_embeddings: bool = true, max_position: int = 131072,
             sliding_window: int = 512, sliding_layers: list, query_pre_attn_scalar: float = 256.0,
             final_softcap: float = 0.0, prefix: str = "model.") {
  param embed: [vocab, hidden]                  from "{prefix}embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index
    param attn_norm: [hidden]                   from "{prefix}layers.{i}.input_layernorm.weight" + 1.0
    param wq: [heads * head_dim, hidden]        from "{prefix}layers.{i}.self_attn.q_proj.weight"
    param wk: [kv_heads * head_dim, hidden]     from "{prefix}layers.{i}.self_attn.k_proj.weight"
    param wv: [kv_heads * head_dim, hidden]     from "{prefix}layers.{i}.self_attn.v_proj.weight"
    param wo: [hidden, heads * head_dim]        from "{prefix}layers.{i}.self_attn.o_proj.weight"
    param q_norm: [head_dim]                    from "{prefix}layers.{i}.self_attn.q_norm.weight" + 1.0
    param k_norm: [head_dim]                    from "{prefix}layers.{i}.self_attn.k_norm.weight" + 1.0
    param post_attn_norm: [hidden]              from "{prefix}layers.{i}.post_attention_layernorm.weight" + 1.0
    param mlp_norm: [hidden]                    from "{prefix}layers.{i}.pre_feedforward_layernorm.weight" + 1.0
    param post_mlp_norm: [hidden]               from "{prefix}layers.{i}.post_feedforward_layernorm.weight" + 1.0
    param w_gate: [ffn, hidden]                 from "{prefix}layers.{i}.mlp.gate_proj.weight"
    param w_up: [ffn, hidden]                   from "{prefix}layers.{i}.mlp.up_proj.weight"
    param w_down: [hidden, ffn]                 from "{prefix}layers.{i}.mlp.down_proj.weight"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      q = linear(x, wq) |> view(heads, head_dim)
      k = linear(x, wk) |> view(kv_heads, head_dim)
      v = linear(x, wv) |> view(kv_heads, head_dim)
      q = rms_norm(q, q_norm, eps=norm_eps)     # per head, over head_dim
      k = rms_norm(k, k_norm, eps=norm_eps)
      q, k = rope(q, k, theta=per_layer(sliding_layers, rope_local_theta, rope_theta),
                  scaling=per_layer(sliding_layers, "none", rope_scaling),
                  factor=per_layer(sliding_layers, 1.0, rope_factor))
      a = attention(q, k, v, scale=query_pre_attn_scalar ** -0.5,
                    sliding_window=per_layer(sliding_layers, sliding_window, 0))
      h = h + rms_norm(linear(a, wo), post_attn_norm, eps=norm_eps)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      y = linear(gelu_tanh(linear(x, w_gate)) * linear(x, w_up), w_down)
      return h + rms_norm(y, post_mlp_norm, eps=norm_eps)
    }
  }

  param norm: [hidden]                          from "{prefix}norm.weight" + 1.0
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(scale(embedding(tokens, embed), factor=hidden ** 0.5))
    y = logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
    return final_softcap > 0 ? softcap(y, cap=final_softcap) : y
  }
}
