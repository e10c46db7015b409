"""End to end against Hugging Face transformers: checkpoint -> `kiln recipe from-hf` -> `kiln compile`
(full cpu pipeline, generated model.py over the paged KV cache) -> `kiln.LLM`.

For every supported family, with random tiny models built offline: fp32 prompt logprobs within 1e-4 of
HF, 32 greedy tokens identical to HF's greedy loop, and a batch of prompts of different lengths gives
the same tokens and logprobs as each prompt alone.
"""
from __future__ import annotations

import pytest

import kiln

ARCHS = ["llama", "llama3_rope", "llama_tied", "llama_head_dim", "mistral", "qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module")
def compiled(compile_hf):
    return lambda arch, **kw: compile_hf(arch, **kw)[:2]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf(arch, compiled, check_hf_parity):
    ckpt, art = compiled(arch)
    check_hf_parity(art, ckpt, vocab=512)


def test_phi3_with_a_sliding_window_matches_hf(compiled, check_hf_parity):
    """Phi-3-mini-4k's config has sliding_window = 2047: here 16, so the 40-token prompt crosses it."""
    ckpt, art = compiled("phi3", sliding_window=16)
    check_hf_parity(art, ckpt, vocab=512)


def test_sharded_checkpoint_matches_single(compiled):
    _, art_single = compiled("llama")
    _, art_sharded = compiled("llama", num_shards=3)
    prompt = [[7, 8, 9, 10, 11, 12]]
    params = kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    a = kiln.LLM(str(art_single)).generate(prompt, params)[0]
    b = kiln.LLM(str(art_sharded)).generate(prompt, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [d and d[t].logprob for d, t in zip(a.prompt_logprobs, prompt[0])] == \
        [d and d[t].logprob for d, t in zip(b.prompt_logprobs, prompt[0])]


def test_text_prompt_and_artifact_main(compiled, capsys):
    from kiln.cli import artifact_main

    _, art = compiled("llama")
    llm = kiln.LLM(str(art))
    out = llm.generate("The quick brown fox", kiln.SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
    assert artifact_main(str(art), ["generate", "The quick brown fox", "--max-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("The quick brown fox") and printed.strip() == ("The quick brown fox" + out.outputs[0].text).strip()
