"""End to end against Hugging Face transformers: checkpoint -> `kiln recipe from-hf` -> `kiln compile`
(full cpu pipeline, generated model.py over the paged KV cache) -> `kiln.LLM`.

For every supported family, with random tiny models built offline: fp32 prompt logprobs within 1e-4 of
HF, 32 greedy tokens identical to HF's greedy loop, and a batch of prompts of different lengths gives
the same tokens and logprobs as each prompt alone.
"""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.cli import main

ARCHS = ["llama", "llama3_rope", "llama_tied", "llama_head_dim", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = (5, 17, 40)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def build(arch: str, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            ckpt = tiny_checkpoint(arch, **kw)
            work = tmp_path_factory.mktemp(f"art_{arch}")
            recipe = work / "recipe.dsl"
            assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
            kiln.compile(recipe, work / "art", progress=False)
            cache[key] = (ckpt, work / "art")
        return cache[key]

    return build


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_reference(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """HF prompt logprobs of each actual next prompt token, and a plain greedy loop (no KV cache)."""
    ids = torch.tensor([prompt])
    logp = model(ids).logits[0].float().log_softmax(-1)
    prompt_lp = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    out = list(prompt)
    for _ in range(NEW_TOKENS):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return prompt_lp, out[len(prompt):]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf(arch, compiled, tiny_checkpoint_lib):
    ckpt, art = compiled(arch)
    hf = tiny_checkpoint_lib.load_hf_model(ckpt)
    llm = kiln.LLM(str(art))
    prompts = _prompts(hf.config.vocab_size)
    params = kiln.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    batch = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batch, strict=True):
        ref_lp, ref_tokens = _hf_reference(hf, prompt)
        assert out.prompt_logprobs[0] is None
        ours = torch.tensor([out.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0])
        torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == ref_tokens, f"{arch}: greedy tokens differ from HF"
        alone = llm.generate([prompt], params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        alone_lp = [alone.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0]
        torch.testing.assert_close(torch.tensor(alone_lp), ours, atol=1e-5, rtol=0)


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
