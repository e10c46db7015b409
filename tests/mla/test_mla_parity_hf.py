"""DeepSeek MLA end to end against Hugging Face (tiny V3 and V2 checkpoints: layer 0 dense, layers 1-2
mixture-of-experts with a shared expert, so both block kinds of models/deepseek_v3.dsl run): checkpoint -> `kiln recipe from-hf` -> `kiln compile` (cpu
pipeline, latent-only paged KV cache) -> `kiln.LLM`, with the MLA absorption pass on (decodes absorbed) and
off (`passes { disable = ["mla_absorption"] }`): fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens
identical to HF's greedy loop, and a batch equal to each prompt alone."""
from __future__ import annotations

import json

import pytest
import torch
from kiln.compiler.report import mla_kv_geometry

import kiln
from kiln.cli import main

PROMPT_LENS = (5, 17, 40)
NEW_TOKENS = 32
VARIANTS = [("deepseek_v3", True), ("deepseek_v3", False), ("deepseek_v2", True), ("deepseek_v2", False)]


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def build(arch: str, absorb: bool):
        if (arch, absorb) not in cache:
            ckpt = tiny_checkpoint(arch)
            work = tmp_path_factory.mktemp(f"art_{arch}_{absorb}")
            recipe = work / "recipe.dsl"
            assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
            if not absorb:
                text = recipe.read_text().rstrip()
                assert text.endswith("}")
                recipe.write_text(text[:-1] + '  passes    { disable = ["mla_absorption"] }\n}\n')
            result = kiln.compile(recipe, work / "art", progress=False)
            cache[arch, absorb] = (ckpt, work / "art", result)
        return cache[arch, absorb]

    return build


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint_lib):
    cache = {}

    @torch.no_grad()
    def ref(ckpt, prompt):
        key = (str(ckpt), tuple(prompt))
        if key not in cache:
            model = tiny_checkpoint_lib.load_hf_model(ckpt)
            ids = torch.tensor([prompt])
            logp = model(ids).logits[0].float().log_softmax(-1)
            out = list(prompt)
            for _ in range(NEW_TOKENS):
                out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            cache[key] = (logp[:-1].gather(1, ids[0, 1:, None])[:, 0], out[len(prompt):])
        return cache[key]

    return ref


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch,absorb", VARIANTS, ids=["v3-absorbed", "v3-unabsorbed", "v2-absorbed", "v2-unabsorbed"])
def test_matches_hf(arch, absorb, compiled, hf_reference):
    ckpt, art, result = compiled(arch, absorb)
    absorbs = [n.attrs.get("absorb", "none") for g in result.program.graphs.values() for _, n in g.items()
               if n.op == "mla_attention"]
    assert absorbs == ["decode" if absorb else "none"] * 2  # one per block kind: dense, moe
    assert sum(g.count("moe_experts") for g in result.program.graphs.values()) == 1
    llm = kiln.LLM(str(art))
    prompts = _prompts(512)
    params = kiln.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    batch = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batch, strict=True):
        ref_lp, ref_tokens = hf_reference(ckpt, prompt)
        ours = torch.tensor([out.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0])
        torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == ref_tokens, f"{arch} absorb={absorb}: greedy tokens differ from HF"
        alone = llm.generate([prompt], params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        alone_lp = [alone.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0]
        torch.testing.assert_close(torch.tensor(alone_lp), ours, atol=1e-5, rtol=0)


def test_manifest_runtime_and_report_use_the_latent_layout(compiled):
    _, art, result = compiled("deepseek_v3", True)
    kv = json.loads((art / "manifest.json").read_text())["kv_cache"]
    layers, lora, rope = 3, 32, 8
    assert kv["layout"] == ["num_blocks", "block_size", "latent_dim"]
    assert (kv["num_layers"], kv["kv_lora_rank"], kv["qk_rope_head_dim"], kv["latent_dim"]) == (
        layers, lora, rope, lora + rope)
    assert kv["bytes_per_token"] == layers * (lora + rope) * 4  # fp32
    assert mla_kv_geometry(result.program) == (layers, lora + rope)
    assert f"KV bytes per token     {layers * (lora + rope) * 4} B" in result.report
    assert "MLA layers x latent 40" in result.report

    model_py = (art / "model.py").read_text()
    assert 'absorb="decode"' in model_py and "K.mla_attention(" in model_py

    caches = kiln.LLM(str(art)).engine.runner.kv_caches  # one [num_blocks, block_size, latent_dim] per layer
    assert len(caches) == layers and all(c.dim() == 3 and c.shape[1:] == (16, lora + rope) for c in caches)
