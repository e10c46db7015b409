"""Mixtral and Qwen3-MoE end to end against Hugging Face transformers: tiny random checkpoints (4 experts, top-2,
stored one tensor per expert) -> `kiln recipe from-hf` -> `kiln compile` (cpu pipeline, generated model.py) ->
`kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens identical, a batch == each prompt alone."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_matches_hf(arch, compile_hf, check_hf_parity):
    ckpt, art, _ = compile_hf(arch)
    model_py = (art / "model.py").read_text()
    assert "K.moe_topk_softmax(" in model_py and "K.moe_experts(" in model_py
    assert "wgate_up" in model_py  # fuse_expert_gate_up ran: one GEMM per expert for gate and up
    check_hf_parity(art, ckpt, vocab=512)
