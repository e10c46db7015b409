"""kiln with a LoRA adapter against HF peft (PeftModel over transformers), random tiny llama and random adapters
built offline: fp32 log-probabilities within 1e-4 for each target combination, and greedy tokens identical."""
from __future__ import annotations

import pytest
import torch
from lora_testlib import ATTENTION, ATTENTION_MLP, peft_greedy, peft_logits

import kiln

PROMPTS = [[5, 17, 33, 101, 7, 250, 9, 11, 400, 3, 77, 12, 13, 14, 15, 16, 300, 301, 2, 9], [44, 45, 46, 200, 8]]
TOP = 20  # prompt logprobs compared per position: the actual token and the top 20 of kiln's distribution

CASES = {
    "attention": dict(targets=ATTENTION),
    "attention_mlp": dict(targets=ATTENTION_MLP),
    # q/k/v are one fused linear in kiln: q and v adapted, k's rows of the branch zero
    "fused_qv": dict(targets=["q_proj", "v_proj"], rank=4),
    # all of the fused q/k/v, with rsLoRA scaling and a per-module rank
    "fused_qkv_rslora": dict(targets=["q_proj", "k_proj", "v_proj"], rank=8, use_rslora=True,
                             rank_pattern={"k_proj": 4}, alpha_pattern={"v_proj": 32}),
}


def _check(art, name, adapter_dir, ckpt, load_hf_model):
    llm = kiln.LLM(str(art))
    params = kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate(PROMPTS, params, lora=name)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = peft_logits(ckpt, adapter_dir, prompt, load_hf_model).log_softmax(-1)
        base = peft_logits(ckpt, None, prompt, load_hf_model).log_softmax(-1)
        assert (ref - base).abs().max() > 0.05, "the adapter must move the logits for the test to mean anything"
        for j in range(1, len(prompt)):
            got = out.prompt_logprobs[j]
            ids = torch.tensor(list(got))
            ours = torch.tensor([lp.logprob for lp in got.values()])
            torch.testing.assert_close(ours, ref[j - 1, ids], atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == peft_greedy(ckpt, adapter_dir, prompt, 8, load_hf_model)


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_match_peft(case, adapter, compile_lora, tiny_checkpoint, tiny_checkpoint_lib):
    kw = dict(CASES[case])
    path = adapter(kw.pop("targets"), **kw)
    art = compile_lora("max_loras = 2; max_rank = 8", {"ad": path})
    _check(art, "ad", path, tiny_checkpoint("llama"), tiny_checkpoint_lib.load_hf_model)


def test_adapter_loaded_at_run_time_matches_peft(adapter, compile_lora, tiny_checkpoint, tiny_checkpoint_lib):
    path = adapter(ATTENTION_MLP, seed=3)
    art = compile_lora("max_loras = 2; max_rank = 8")
    llm = kiln.LLM(str(art))
    llm.engine.load_lora_adapter("late", str(path))
    assert llm.engine.list_lora_adapters() == ["late"]
    ckpt = tiny_checkpoint("llama")
    params = kiln.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([PROMPTS[0]], params, lora="late")[0]
    ref = peft_logits(ckpt, path, PROMPTS[0], tiny_checkpoint_lib.load_hf_model).log_softmax(-1)
    ours = torch.tensor([out.prompt_logprobs[j][t].logprob for j, t in enumerate(PROMPTS[0]) if j > 0])
    torch.testing.assert_close(ours, ref[:-1].gather(1, torch.tensor(PROMPTS[0][1:])[:, None])[:, 0], atol=1e-4,
                               rtol=0)
    base = llm.generate([PROMPTS[0]], params)[0]  # the base model, same engine
    base_ref = peft_logits(ckpt, None, PROMPTS[0], tiny_checkpoint_lib.load_hf_model).log_softmax(-1)
    ours = torch.tensor([base.prompt_logprobs[j][t].logprob for j, t in enumerate(PROMPTS[0]) if j > 0])
    torch.testing.assert_close(ours, base_ref[:-1].gather(1, torch.tensor(PROMPTS[0][1:])[:, None])[:, 0],
                               atol=1e-4, rtol=0)
