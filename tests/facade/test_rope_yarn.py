"""YaRN rope scaling end to end: `kiln recipe from-hf` maps a config's yarn `rope_scaling` / `rope_parameters`
(and DeepSeek's yarn mscale on the softmax scale), and compiled tiny checkpoints match Hugging Face at positions
past the original context: fp32 prompt logprobs within 1e-4, greedy tokens identical (check_hf_parity).
The tables themselves: tests/codegen/test_rope_yarn_kernels.py."""
from __future__ import annotations

import json
import math
import re

import pytest

from kiln.recipe_from_hf import UnsupportedCheckpoint, recipe_from_hf

# the parity prompts (6 and 40 tokens, then 12 generated) run past the original context of 32
MAX_POS, ORIGINAL = 128, 32
PARITY = {"lens": (6, 40), "new_tokens": 12}
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# mscale != mscale_all_dim: cos/sin are scaled by (1 + 0.1 ln 4) / (1 + 0.08 ln 4), the softmax by (1 + 0.08 ln 4)²
DEEPSEEK_YARN = {**QWEN_YARN, "beta_fast": 16, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
DISABLE_ABSORPTION = (("  serve ", '  passes    { disable = ["mla_absorption"] }\n  serve '),)

# the config.json of every published DeepSeek-V3 / R1 checkpoint, as on disk (transformers 4 spelling)
V3_PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "intermediate_size": 18432, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
QWEN3_BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "max_position_embeddings": 131072, "rope_theta": 1000000.0}


def _recipe(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return recipe_from_hf(tmp_path)


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=([^,\n)]+)", text.split("model", 1)[1].split("weights")[0]))


def test_from_hf_published_deepseek_v3(tmp_path):
    args = _args(_recipe(tmp_path, V3_PUBLISHED))
    assert {k: args[k] for k in args if k.startswith("rope_")} == {
        "rope_theta": "10000.0", "rope_interleave": "true", "rope_scaling": '"yarn"', "rope_factor": "40.0",
        "rope_original_max_position": "4096", "rope_beta_fast": "32.0", "rope_beta_slow": "1.0",
        "rope_mscale": "1.0", "rope_mscale_all_dim": "1.0"}
    assert float(args["mscale"]) == pytest.approx(0.1 * math.log(40) + 1, rel=1e-15)  # HF yarn_get_mscale(40, 1)


def test_from_hf_qwen_yarn_both_spellings(tmp_path):
    legacy = _args(_recipe(tmp_path, {**QWEN3_BASE, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
    current = _args(_recipe(tmp_path, {**QWEN3_BASE, "rope_theta": None, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}}))
    assert legacy == current
    assert (legacy["rope_scaling"], legacy["rope_factor"], legacy["rope_original_max_position"]) == (
        '"yarn"', "4.0", "32768")
    assert "rope_mscale" not in legacy and "rope_attention_factor" not in legacy and "rope_truncate" not in legacy


def test_from_hf_yarn_defaults_as_transformers(tmp_path):
    # no factor: the context ratio; a top-level original_max_position_embeddings wins (Phi-3 style); truncate off
    args = _args(_recipe(tmp_path, {**QWEN3_BASE, "original_max_position_embeddings": 16384, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 32768, "attention_factor": 1.25, "truncate": False}}))
    assert (args["rope_factor"], args["rope_original_max_position"]) == ("8.0", "16384")
    assert (args["rope_attention_factor"], args["rope_truncate"]) == ("1.25", "false")


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic' \(NTK\) rope scaling is not supported: transformers "
                                              r"recomputes its frequencies from the running sequence length"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
     r"rope scaling type 'longrope' is not supported yet \(supported: llama3, linear, yarn; longrope for Phi-3 "
     r"checkpoints\)"),
])
def test_from_hf_refuses_other_scalings_clearly(tmp_path, scaling, message):
    with pytest.raises(UnsupportedCheckpoint, match=message):
        _recipe(tmp_path, {**QWEN3_BASE, "rope_scaling": scaling})


@pytest.fixture(scope="module")
def qwen3_yarn(compile_hf):
    # legacy_config: the checkpoint's config.json spells it `rope_scaling`, as most on the hub
    return compile_hf("qwen3", legacy_config=True, max_position_embeddings=MAX_POS, rope_parameters=QWEN_YARN)


def test_qwen3_yarn_matches_hf(qwen3_yarn, check_hf_parity):
    ckpt, art, _ = qwen3_yarn
    assert json.loads((ckpt / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    assert 'scaling="yarn", factor=4.0, original_max_position=32' in (art / "model.py").read_text()
    check_hf_parity(art, ckpt, vocab=512, **PARITY)


@pytest.mark.parametrize("arch,absorb", [("deepseek_v3", True), ("deepseek_v3", False), ("deepseek_v2", True)],
                         ids=["v3-absorbed", "v3-unabsorbed", "v2-absorbed"])
def test_deepseek_yarn_matches_hf(compile_hf, check_hf_parity, arch, absorb):
    ckpt, art, result = compile_hf(arch, edits=() if absorb else DISABLE_ABSORPTION,
                                   max_position_embeddings=MAX_POS, rope_parameters=DEEPSEEK_YARN)
    assert (ckpt / "config.json").read_text().count('"yarn"') == 1
    absorbs = {n.attrs.get("absorb", "none") for g in result.program.graphs.values() for _, n in g.items()
               if n.op == "mla_attention"}
    assert absorbs == {"decode" if absorb else "none"}
    check_hf_parity(art, ckpt, vocab=512, **PARITY)


@pytest.mark.parametrize("top_theta", [55.0, None])
def test_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path, top_theta):
    """Both keys present: transformers 5 takes the non-empty legacy `rope_scaling` whole (`rope_parameters` and its
    theta dropped), theta from the top level (else the config class's default). from-hf follows it."""
    from transformers import AutoConfig

    cfg = {**QWEN3_BASE, "model_type": "qwen3", "rope_theta": top_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": 123.0},
           "rope_scaling": {"rope_type": "linear", "factor": 3.0}}
    if top_theta is None:
        del cfg["rope_theta"]
    args = _args(_recipe(tmp_path, cfg))
    hf = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert hf["rope_type"] == "linear"  # what transformers resolves, not a value copied from kiln
    assert args["rope_scaling"] == '"linear"' and float(args["rope_factor"]) == hf["factor"]
    assert float(args["rope_theta"]) == hf["rope_theta"]


def test_empty_legacy_rope_scaling_leaves_rope_parameters(tmp_path):
    from transformers import AutoConfig

    cfg = {**QWEN3_BASE, "model_type": "qwen3", "rope_scaling": {},
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}}
    args = _args(_recipe(tmp_path, cfg))
    hf = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert (args["rope_scaling"], float(args["rope_factor"]), float(args["rope_theta"])) == (
        f'"{hf["rope_type"]}"', hf["factor"], hf["rope_theta"])
