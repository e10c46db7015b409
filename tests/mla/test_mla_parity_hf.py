"""DeepSeek MLA end to end against Hugging Face (tiny V3 and V2 checkpoints: layer 0 dense, layers 1-2
mixture-of-experts with a shared expert, so both block kinds of models/deepseek_v3.dsl run): checkpoint -> `kiln recipe from-hf` -> `kiln compile` (cpu
pipeline, latent-only paged KV cache) -> `kiln.LLM`, with the MLA absorption pass on (decodes absorbed) and
off (`passes { disable = ["mla_absorption"] }`): fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens
identical to HF's greedy loop, and a batch equal to each prompt alone."""
from __future__ import annotations

import json

import pytest
from kiln.compiler.kv_layout import kv_layout

import kiln

VARIANTS = [("deepseek_v3", True), ("deepseek_v3", False), ("deepseek_v2", True), ("deepseek_v2", False)]
DISABLE_ABSORPTION = (("  serve ", '  passes    { disable = ["mla_absorption"] }\n  serve '),)


@pytest.fixture(scope="module")
def compiled(compile_hf):
    return lambda arch, absorb: compile_hf(arch, edits=() if absorb else DISABLE_ABSORPTION)


@pytest.mark.parametrize("arch,absorb", VARIANTS, ids=["v3-absorbed", "v3-unabsorbed", "v2-absorbed", "v2-unabsorbed"])
def test_matches_hf(arch, absorb, compiled, check_hf_parity):
    ckpt, art, result = compiled(arch, absorb)
    absorbs = [n.attrs.get("absorb", "none") for g in result.program.graphs.values() for _, n in g.items()
               if n.op == "mla_attention"]
    assert absorbs == ["decode" if absorb else "none"] * 2  # one per block kind: dense, moe
    assert sum(g.count("moe_experts") for g in result.program.graphs.values()) == 1
    check_hf_parity(art, ckpt, vocab=512)


def test_manifest_runtime_and_report_use_the_latent_layout(compiled):
    _, art, result = compiled("deepseek_v3", True)
    kv = json.loads((art / "manifest.json").read_text())["kv_cache"]
    layers, lora, rope = 3, 32, 8
    assert kv["layout"] == ["num_blocks", "block_size", "latent_dim"]
    assert (kv["num_layers"], kv["kv_lora_rank"], kv["qk_rope_head_dim"], kv["latent_dim"]) == (
        layers, lora, rope, lora + rope)
    assert kv["bytes_per_token"] == layers * (lora + rope) * 4  # fp32
    kv = kv_layout(result.program)
    assert (kv.kind, kv.num_layers, kv.latent_dim) == ("mla", layers, lora + rope)
    assert f"KV bytes per token     {layers * (lora + rope) * 4} B" in result.report
    assert "MLA layers x latent 40" in result.report

    model_py = (art / "model.py").read_text()
    assert 'absorb="decode"' in model_py and "K.mla_attention(" in model_py

    caches = kiln.LLM(str(art)).engine.runner.kv_caches  # one [num_blocks, block_size, latent_dim] per layer
    assert len(caches) == layers and all(c.dim() == 3 and c.shape[1:] == (16, lora + rope) for c in caches)
