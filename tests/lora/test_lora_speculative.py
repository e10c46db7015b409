"""LoRA with speculative decoding (n-gram lookup, a draft model): the verify rows of a sequence carry its adapter,
the proposer drafts without adapters (drafts are proposals), so greedy outputs with adapters equal decoding
without speculation at k = 1, 2, 4, and a batch mixing adapters and the base gives each request the tokens it
gets alone. A draft head (mtp) with LoRA is refused (at compile time: test_lora_compile_errors.py; at run time
here)."""
from __future__ import annotations

import pytest
import torch
from lora_testlib import ATTENTION, ATTENTION_MLP, lora_recipe

import kiln

NAMES = ["a0", None, "a1", "a0", None, "a1"]


def _prompts() -> list[list[int]]:
    """Random prompts and ones repeating a phrase (what prompt lookup drafts from)."""
    g = torch.Generator().manual_seed(4)
    phrase = torch.randint(5, 512, (6,), generator=g).tolist()
    rand = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (9, 23, 5)]
    return [phrase * 3 + [9], rand[0], rand[1], [7] + phrase * 2, rand[2], phrase * 4]


def _greedy(n: int = 16):
    return kiln.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def art(adapter, compile_lora):
    return compile_lora("max_loras = 2; max_rank = 8",
                        {"a0": adapter(ATTENTION_MLP, seed=21), "a1": adapter(ATTENTION, seed=22)})


@pytest.fixture(scope="module")
def plain(art):
    """Without speculation: each request alone, with its adapter."""
    llm = kiln.LLM(str(art), speculative=None)
    outs = [llm.generate([p], _greedy(), lora=n)[0] for p, n in zip(_prompts(), NAMES, strict=True)]
    base = _tokens(llm.generate(_prompts(), _greedy()))
    assert _tokens(outs) != base, "the adapters must change the outputs for the test to mean anything"
    return _tokens(outs)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_adapters_equals_plain_decoding(art, plain, method, k):
    # the draft: the artifact itself, run without adapters (the draft model's runner has no adapter slots)
    extra = {"speculative_model": str(art)} if method == "draft" else {}
    llm = kiln.LLM(str(art), speculative=method, num_speculative_tokens=k, **extra)
    batch = _tokens(llm.generate(_prompts(), _greedy(), lora=NAMES))
    assert batch == plain
    s = llm.engine.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] > 0
    if method == "draft":  # base-model drafts for adapted requests: some rejected (the adapters matter)
        assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    alone = [_tokens(llm.generate([p], _greedy(), lora=n))[0] for p, n in zip(_prompts(), NAMES, strict=True)]
    assert alone == plain


def test_ngram_with_lora_compiles(tmp_path, tiny_checkpoint):
    from kiln.cli import main

    recipe = tmp_path / "recipe.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(recipe)]) == 0
    text = lora_recipe(recipe.read_text(), "max_loras = 2").replace(
        "  lora {", "  speculative { method = ngram; tokens = 3 }\n  lora {")
    recipe.write_text(text)
    res = kiln.compile(recipe, tmp_path / "art", progress=False)
    assert res.manifest["speculative"]["method"] == "ngram" and res.manifest["lora"]["max_loras"] == 2


def test_runtime_draft_head_on_a_lora_artifact_is_refused():
    from kiln.runtime.config import speculative_config
    from kiln.runtime.errors import ArtifactError

    manifest = {"lora": {"max_loras": 2}, "drafts": {"mtp": {"method": "mtp_head"}}}
    with pytest.raises(ArtifactError, match="a draft head with LoRA adapters is not supported"):
        speculative_config(manifest, "mtp", 1)
    assert speculative_config(manifest, "ngram", 2).method == "ngram"
