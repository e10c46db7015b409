"""Phi-3.5 / Phi-4-mini rope end to end: LongRoPE factors and partial rotary, from `kiln recipe from-hf` to
`kiln.LLM`, against Hugging Face transformers.

kiln's rule (docs/rope.md): keys are cached rotated, so an artifact picks one LongRoPE factor set for every
sequence, from the longest context it serves (MAX_MODEL_LEN): the short factors when it serves at most
original_max_position_embeddings, else the long ones. transformers picks per forward, by the running sequence
length (and recomputes its cache when a sequence crosses). So:
* an artifact serving at most the original context equals transformers on every request;
* an artifact serving beyond it equals transformers on every step whose sequence is longer than the original
  context (a prompt longer than it: prompt logprobs and every generated token), and departs from it below.
Both are checked here on the tiny `phi4_mini` checkpoint (3/4 of each head rotates; original context 32 of 128):
fp32 prompt logprobs within 1e-4, greedy tokens identical (check_hf_parity). Kernels: tests/codegen."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from kiln.dsl.errors import SourceError

from kiln.recipe_from_hf import UnsupportedCheckpoint, recipe_from_hf

ORIGINAL = 32  # the phi4_mini checkpoint's original_max_position_embeddings (max_position_embeddings 128)
SERVE_ORIGINAL = (("  serve     { port", f"  serve     {{ max_model_len = {ORIGINAL}; port"),)


def _published(hidden: int, heads: int, kv_heads: int, rotary: float) -> dict:
    """The config.json of Phi-3.5-mini-instruct (rotary 1) / Phi-4-mini-instruct (rotary 0.75) as published,
    synthetic factor values (one per rotated dim pair: 48 each for both)."""
    pairs = int(hidden // heads * rotary) // 2
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": hidden,
            "num_hidden_layers": 32, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": 8192, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "sliding_window": 262144,
            **({"partial_rotary_factor": rotary} if rotary != 1 else {}),
            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(pairs)],
                             "long_factor": [1.0 + i for i in range(pairs)]}}


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\[[^\]]*\]|[^,\n)]+)", text.split("model", 1)[1].split("weights")[0]))


@pytest.mark.parametrize("rotary", [1.0, 0.75], ids=["phi3.5-mini", "phi4-mini"])
def test_from_hf_published_configs_resolve_as_transformers(tmp_path, rotary):
    from kiln.compiler.ops import longrope_factors, rope_attention_factor, rope_inv_freq
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _published(3072, 32 if rotary == 1 else 24, 32 if rotary == 1 else 8, rotary)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = recipe_from_hf(tmp_path)
    args = _args(text)
    head_dim = 3072 // int(args["heads"])
    rotary_dim = int(args.get("rope_rotary_dim", head_dim))
    assert ("rope_rotary_dim" in args) == (rotary != 1) and rotary_dim == int(head_dim * rotary)
    assert (args["rope_scaling"], args["rope_factor"], args["rope_original_max_position"]) == ('"longrope"', "32.0",
                                                                                              "4096")
    short, long = (tuple(json.loads(args[f"rope_{k}_factor"])) for k in ("short", "long"))
    assert "# LongRoPE: 131072 positions > original 4096: the long factors for every request" in text
    hf = AutoConfig.from_pretrained(tmp_path)
    for seq_len in (4096, 4097):  # transformers' two branches, and the factor set kiln takes for each
        inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        ext = longrope_factors(short, long, 4096, seq_len)
        inv = rope_inv_freq(rotary_dim, float(args["rope_theta"]), "longrope", float(args["rope_factor"]), 1.0, 4.0,
                            4096, longrope_factors=ext)
        assert torch.equal(inv, inv_hf)
        assert rope_attention_factor("longrope", float(args["rope_factor"]), original_max_position=4096) == factor_hf
    assert factor_hf == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_from_hf_legacy_su_name_and_given_attention_factor(tmp_path):
    cfg = _published(64, 4, 4, 0.75)
    cfg["rope_scaling"] = {**cfg["rope_scaling"], "type": "su", "attention_factor": 1.25, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = _args(recipe_from_hf(tmp_path))
    assert (args["rope_scaling"], args["rope_factor"], args["rope_attention_factor"], args["rope_rotary_dim"]) == (
        '"longrope"', "2.0", "1.25", "12")


@pytest.mark.parametrize("edit,error,message", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, UnsupportedCheckpoint,
     r"Phi-3 rope scaling 'linear' is not supported: transformers' Phi-3 knows only longrope"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 5}}, SourceError,
     r"'long_factor' must list one positive factor per rotated dim pair \(6\), got 5 entries"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 5 + [-1.0], "long_factor": [2.0] * 6}},
     SourceError, r"'short_factor' must list one positive factor per rotated dim pair \(6\), got 6 entries"),
    ({"partial_rotary_factor": 0.7}, SourceError,
     r"'partial_rotary_factor' = 0.7 rotates 11 of the 16 dims of a head; kiln's rope rotates an even"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                       "attention_factor": -1}}, SourceError, r"'attention_factor' must be a positive number, got -1"),
    ({"hidden_act": "gelu"}, UnsupportedCheckpoint, r"Phi-3 with hidden_act = 'gelu' \(kiln's is silu\)"),
])
def test_phi3_variants_kiln_cannot_compute_are_refused_where_they_are(tmp_path, edit, error, message):
    cfg = {**_published(64, 4, 4, 0.75), **edit}
    (tmp_path / "config.json").write_text(json.dumps(cfg, indent=1))
    with pytest.raises(error, match=message) as e:
        recipe_from_hf(tmp_path)
    if error is SourceError:  # at the key's line in config.json
        assert e.value.loc.line > 1 and e.value.loc.file.endswith("config.json")


@pytest.fixture(scope="module")
def served_beyond(compile_hf):
    """The recipe as from-hf writes it: 128 positions > the original 32, the long factors."""
    return compile_hf("phi4_mini")


def test_short_factors_equal_hf_on_an_artifact_serving_the_original_context(compile_hf, check_hf_parity):
    ckpt, art, _ = compile_hf("phi4_mini", edits=SERVE_ORIGINAL)
    source = (art / "model.py").read_text()
    assert "MAX_MODEL_LEN = 32" in source and "<= original_max_position 32: short_factor" in source
    assert "rotary_dim=12" in source and "K.rope(" not in source  # rope fused into the attention's KV write
    check_hf_parity(art, ckpt, vocab=512, lens=(5, 17), new_tokens=12)  # every sequence <= 29 positions


def test_long_factors_equal_hf_on_prompts_past_the_original_context(served_beyond, check_hf_parity):
    ckpt, art, _ = served_beyond
    assert "> original_max_position 32: long_factor" in (art / "model.py").read_text()
    # chunks of 16 tokens: the KV of every chunk is cached with the same (long) rotation
    check_hf_parity(art, ckpt, vocab=512, lens=(40, 50), new_tokens=8, chunked_prefill=16)


def test_phi35_full_rotary_long_factors_equal_hf(compile_hf, check_hf_parity):
    """Phi-3.5-mini's rope: every dim rotates; config.json spelled as on the hub (rope_theta + rope_scaling)."""
    ckpt, art, _ = compile_hf("phi3", legacy_config=True, max_position_embeddings=128,
                              original_max_position_embeddings=ORIGINAL, rope_scaling={
                                  "rope_type": "longrope", "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
                                  "long_factor": [1.0, 1.3, 1.8, 2.7, 4.0, 6.0, 9.0, 14.0]})
    assert "rope_scaling" in json.loads((ckpt / "config.json").read_text())
    assert "rotary_dim" not in (art / "model.py").read_text()
    check_hf_parity(art, ckpt, vocab=512, lens=(45,), new_tokens=8)


def test_an_artifact_serving_beyond_departs_from_hf_below_the_original_context(served_beyond, hf_reference):
    """The documented limit: transformers rotates a 17-token prompt with the short factors, this artifact with
    the long ones (the two differ), so its prompt logprobs are not transformers' there."""
    import kiln

    ckpt, art, _ = served_beyond
    prompt = torch.randint(5, 512, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    params = kiln.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = kiln.LLM(str(art)).generate([prompt], params)[0]
    ours = torch.tensor([out.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j > 0])
    ref, _ = hf_reference(ckpt, prompt, 1)
    assert (ours - ref).abs().max() > 1e-2


def test_a_recipe_factor_out_of_range_is_located(tmp_path, capsys):
    from kiln.cli import main

    model = ('phi3(vocab=64, hidden=32, layers=1, heads=2, ffn=64, rope_scaling="longrope", '
             'rope_original_max_position=16, rope_short_factor=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], '
             'rope_long_factor=[1.0, 2.0, 0.0, 4.0, 5.0, 6.0, 7.0, 8.0])')
    p = tmp_path / "r.dsl"
    p.write_text(f"recipe r {{\n  model = {model}\n  weights = random(seed=0)\n}}\n")
    assert main(["compile", str(p)]) == 2
    col = f"  model = {model}".index("[1.0, 2.0") + 1
    assert capsys.readouterr().err.startswith(
        f"{p}:2:{col}: error: 'rope_long_factor'[2] must be a finite number > 0, got 0.0"), col
