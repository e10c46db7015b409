"""Every model family kiln supports, compiled for a device mesh, against Hugging Face transformers.

The ranks run as the single-process mesh (runtime/worker/distributed/executor.py LocalMeshExecutor): every rank's
model is built from its own weights/rank{r}/ shards and runs the sharded program, the collectives meeting in
this process. The same artifacts over gloo worker processes are test_parallel_gloo.py's. fp32: prompt
logprobs within 1e-4 of HF and 32 greedy tokens identical (check_hf_parity), prompts batched and alone.
"""
from __future__ import annotations

import json

import pytest

NUM_KV_BLOCKS = 64  # per rank (the cpu default pool, 0.25 GiB on every rank, only costs time here)

CASES = [
    ("llama", "tp = 2", {}),  # GQA 4:2, KV heads sharded
    ("llama", "tp = 4", {}),  # 2 KV heads < 4 ranks: each KV head replicated on 2 ranks
    ("llama", "tp = 2", {"vocab_size": 509}),  # vocabulary padded to 510 for the vocab-parallel embedding/LM head
    ("llama", "tp = 2", {"attention_bias": True, "mlp_bias": True}),  # row-parallel o/down bias: added once
    ("llama3_rope", "tp = 2", {}),
    ("mistral", "tp = 2", {}),
    ("qwen2", "tp = 2", {}),  # q/k/v bias: column-parallel biases
    ("qwen3", "tp = 2", {"tie_word_embeddings": True}),
    ("phi3", "tp = 2", {}),  # q/k/v and gate/up fused in the checkpoint: one param cut per segment of its slices  # q/k norm per head; the tied embedding is the LM head
    ("gemma3", "tp = 2", {}),  # sandwich norms, GELU-tanh, per-layer windows and ropes, scaled embeddings
    ("gemma2", "tp = 2", {}),  # soft-capped scores (per head: sharded with the heads) and logits (vocab-sharded)
    ("granite", "tp = 2", {}),  # scaled embeddings, residual branches (partial sums) and logits
    ("mixtral", "tp = 2", {}),  # experts tensor-parallel inside (ep = 1)
    ("mixtral", "tp = 2; ep = 2", {}),  # two whole experts per rank
    ("qwen3_moe", "tp = 2; ep = 2; expert_placement = round_robin", {}),
    ("qwen3_moe", "tp = 4; ep = 2", {}),  # 2 expert groups of 2 ranks, each splitting its experts' width
    ("qwen3_moe", "dp = 2; ep = 2", {}),  # data-parallel attention, experts reached by all_to_all
    ("deepseek_v3", "tp = 2", {}),  # MLA heads sharded; dense layer 0, MoE layers 1-2
    ("deepseek_v3", "dp = 2; ep = 2", {}),  # data-parallel attention around expert-parallel MoE
    ("deepseek_v3", "dp = 2; ep = 2; dense = replicated", {}),  # shared experts per rank, routed by all_to_all
    ("llama", "dp = 2; dense = replicated", {}),  # plain data parallelism: every rank the whole model
    ("gpt_oss", "tp = 2; ep = 2", {}),  # sinks sharded with the query heads; whole biased experts per rank
    ("gpt_oss", "dp = 2; ep = 2", {}),  # data-parallel attention (sinks whole), experts reached by all_to_all
]


@pytest.mark.parametrize(("arch", "mesh", "kw"), CASES, ids=[f"{a}-{m}-{k}" for a, m, k in CASES])
def test_mesh_matches_hf(arch, mesh, kw, compile_parallel, check_hf_parity, local_mesh):
    ckpt, art = compile_parallel(arch, mesh, **kw)
    par = json.loads((art / "manifest.json").read_text())["parallel"]
    assert par["world_size"] > 1
    assert sorted(p.name for p in (art / "weights").iterdir()) == [f"rank{r}" for r in range(par["world_size"])]
    check_hf_parity(art, ckpt, vocab=kw.get("vocab_size", 512), num_kv_blocks=NUM_KV_BLOCKS)
