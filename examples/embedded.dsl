# kiln's embedded default model: a 5.5M-parameter Llama trained from scratch on Debian's fortune cookies
# (scripts/train_embedded.py; data sources and licences in docs/embedded_model.md). Checkpoint: examples/embedded/.
# Regenerate with: kiln recipe from-hf examples/embedded --target cpu --dtype fp32 (served_name set by hand)
recipe embedded {
  model   = llama(vocab=4096, hidden=256, layers=6, heads=8, kv_heads=4, ffn=704,
                  rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=true, max_position=512)
  weights = "hf:./embedded"
  target  = cpu
  dtype   = fp32
  kv_cache  { block_size = 16; memory_fraction = 0.9 }
  # max_batched_tokens: the cpu target's step budget, 2048 tokens (compiler/targets.py), as the benchmarks measure it
  scheduler { max_seqs = 256; chunked_prefill = 512; policy = fcfs; prefix_cache = radix }
  serve     { port = 8000; served_name = "kiln-embedded" }
}
