"""Quantized h200 artifacts on the GPU (merged projections, the Triton quantized GEMM, CUDA graphs) vs the
same quantization compiled for cpu (fp32, torch dequantization), on a tiny random Llama (hidden 128, ffn 256,
group 128).

AWQ weights are packed by tests/quant's reference packer; fp8 weights are quantized at compile time. The
h200 artifact runs fp32 (exact up to summation order: logprobs within 1e-3) or bf16 activations (within 0.5 at
most, 0.1 on average: bf16 alone moves a few tokens by 0.1-0.3 on these models; a wrong layout or scale moves
them by nats), scored teacher-forced over prompts of 5, 40 and 130 tokens plus the GPU's 16 greedy steps.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from quant_testlib import awq_checkpoint, recipe_text  # noqa: E402

# (max, mean) absolute logprob differences from the cpu fp32 artifact. fp32: kernel summation orders only.
# bf16 activations: a few tokens move by ~0.1-0.3 on these random models. A wrong layout or scale: nats.
BOUNDS = {"fp32": (1e-3, 1e-4), "bf16": (0.5, 0.1)}


def _logprobs(out):
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])


@pytest.mark.parametrize("quantize,kernel,dtype", [
    ("awq(group=128)", "triton.linear_w4a16", "fp32"),
    ("awq(group=128)", "triton.linear_w4a16", "bf16"),
    ("fp8", "triton.linear_fp8", "fp32"),  # per-tensor scales, merged into per-channel ones
    ("fp8(per_channel=true)", "triton.linear_fp8", "bf16"),
])
def test_quantized_h200_artifact_vs_cpu(quantize, kernel, dtype, tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("llama", hidden_size=128, intermediate_size=256)
    if quantize.startswith("awq"):
        ckpt = awq_checkpoint(ckpt, tmp_path / "awq_ckpt")
    text = recipe_text(ckpt, f"weights = {quantize}")
    (tmp_path / "cpu.dsl").write_text(text)
    (tmp_path / "gpu.dsl").write_text(text.replace("target = cpu", "target = h200").replace("dtype = fp32",
                                                                                            f"dtype = {dtype}"))
    kiln.compile(tmp_path / "cpu.dsl", tmp_path / "cpu", progress=False)
    kiln.compile(tmp_path / "gpu.dsl", tmp_path / "gpu", progress=False)
    manifest = json.loads((tmp_path / "gpu" / "manifest.json").read_text())
    assert kernel in manifest["kernels"]
    assert any(p["name"].startswith("decoder.wqkv_") for p in manifest["params"])  # merged q/k/v

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 40, 130)]
    greedy = kiln.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    score = kiln.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    cpu, gpu = kiln.LLM(str(tmp_path / "cpu")), kiln.LLM(str(tmp_path / "gpu"), device="cuda")
    max_err, mean_err = BOUNDS[dtype]
    for prompt, out in zip(prompts, gpu.generate(prompts, greedy), strict=True):
        full = prompt + out.outputs[0].token_ids  # the GPU's own decode (CUDA graphs), scored by both
        err = (_logprobs(gpu.generate([full], score)[0]) - _logprobs(cpu.generate([full], score)[0])).abs()
        assert float(err.max()) < max_err and float(err.mean()) < mean_err, f"{quantize} {dtype}: {err}"
