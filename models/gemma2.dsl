# Gemma 2 (HF Gemma2ForCausalLM): Gemma 3's decoder (models/gemma3.dsl: embeddings times sqrt(hidden), 1 + w
# norms, sandwich norms, GELU-tanh MLP, query_pre_attn_scalar) without q/k norms and with one rope for every
# layer; sliding-window and global layers alternate (`sliding_layers`); attention scores are soft-capped
# (attn_softcap · tanh(s / attn_softcap), 50 in Google's checkpoints) and so are the final logits (30).
model gemma2(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int = heads,
             head_dim: int = hidden // heads, ffn: int, rope_theta: float = 10000.0, norm_eps: float = 1e-6,
             tie_embeddings: bool = true, max_position: int = 8192, sliding_window: int = 4096,
             sliding_layers: list, query_pre_attn_scalar: float = 256.0, attn_softcap: float = 0.0,
             final_softcap: float = 0.0) {
  param embed: [vocab, hidden]                  from "model.embed_tokens.weight"

  block decoder[layers] {                       # {i} is the layer index
    param attn_norm: [hidden]                   from "model.layers.{i}.input_layernorm.weight" + 1.0
    param wq: [heads * head_dim, hidden]        from "model.layers.{i}.self_attn.q_proj.weight"
    param wk: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.k_proj.weight"
    param wv: [kv_heads * head_dim, hidden]     from "model.layers.{i}.self_attn.v_proj.weight"
    param wo: [hidden, heads * head_dim]        from "model.layers.{i}.self_attn.o_proj.weight"
    param post_attn_norm: [hidden]              from "model.layers.{i}.post_attention_layernorm.weight" + 1.0
    param mlp_norm: [hidden]                    from "model.layers.{i}.pre_feedforward_layernorm.weight" + 1.0
    param post_mlp_norm: [hidden]               from "model.layers.{i}.post_feedforward_layernorm.weight" + 1.0
    param w_gate: [ffn, hidden]                 from "model.layers.{i}.mlp.gate_proj.weight"
    param w_up: [ffn, hidden]                   from "model.layers.{i}.mlp.up_proj.weight"
    param w_down: [hidden, ffn]                 from "model.layers.{i}.mlp.down_proj.weight"

    forward(h) {
      x = rms_norm(h, attn_norm, eps=norm_eps)
      q = linear(x, wq) |> view(heads, head_dim)
      k = linear(x, wk) |> view(kv_heads, head_dim)
      v = linear(x, wv) |> view(kv_heads, head_dim)
      q, k = rope(q, k, theta=rope_theta)
      a = attention(q, k, v, scale=query_pre_attn_scalar ** -0.5, softcap=attn_softcap,
                    sliding_window=per_layer(sliding_layers, sliding_window, 0))
      h = h + rms_norm(linear(a, wo), post_attn_norm, eps=norm_eps)
      x = rms_norm(h, mlp_norm, eps=norm_eps)
      y = linear(gelu_tanh(linear(x, w_gate)) * linear(x, w_up), w_down)
      return h + rms_norm(y, post_mlp_norm, eps=norm_eps)
    }
  }

  param norm: [hidden]                          from "model.norm.weight" + 1.0
  param lm_head: [vocab, hidden]                from "lm_head.weight" if !tie_embeddings

  forward(tokens) {
    h = decoder(scale(embedding(tokens, embed), factor=hidden ** 0.5))
    y = logits(rms_norm(h, norm, eps=norm_eps), tie_embeddings ? embed : lm_head)
    return final_softcap > 0 ? softcap(y, cap=final_softcap) : y
  }
}
