"""Mixtral and Qwen3-MoE end to end against Hugging Face transformers: tiny random checkpoints (4 experts, top-2,
stored one tensor per expert) -> `kiln recipe from-hf` -> `kiln compile` (cpu pipeline, generated model.py) ->
`kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens identical, a batch == each prompt alone."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.cli import main

PROMPT_LENS = (5, 17, 40)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, tmp_path_factory):
    def build(arch: str):
        ckpt = tiny_checkpoint(arch)
        work = tmp_path_factory.mktemp(f"moe_{arch}")
        recipe = work / "recipe.dsl"
        assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
        kiln.compile(recipe, work / "art", progress=False)
        return ckpt, work / "art"

    return build


@torch.no_grad()
def _hf_reference(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    logp = model(ids).logits[0].float().log_softmax(-1)
    prompt_lp = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    out = list(prompt)
    for _ in range(NEW_TOKENS):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return prompt_lp, out[len(prompt):]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_matches_hf(arch, compiled, tiny_checkpoint_lib):
    ckpt, art = compiled(arch)
    model_py = (art / "model.py").read_text()
    assert "K.moe_topk_softmax(" in model_py and "K.moe_experts(" in model_py
    assert "wgate_up" in model_py  # fuse_expert_gate_up ran: one GEMM per expert for gate and up
    hf = tiny_checkpoint_lib.load_hf_model(ckpt)
    llm = kiln.LLM(str(art))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = kiln.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    batch = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batch, strict=True):
        ref_lp, ref_tokens = _hf_reference(hf, prompt)
        ours = torch.tensor([out.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0])
        torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == ref_tokens, f"{arch}: greedy tokens differ from HF"
        alone = llm.generate([prompt], params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        alone_lp = [alone.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0]
        torch.testing.assert_close(torch.tensor(alone_lp), ours, atol=1e-5, rtol=0)
