"""Gemma 3 text and Gemma 2 end to end against Hugging Face transformers: a random tiny checkpoint ->
`kiln recipe from-hf` -> `kiln compile` (cpu) -> `kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF and 32
greedy tokens identical to HF's (tests/conftest.py check_hf_parity; Gemma 2: 16), on a prompt of 40 tokens
with a sliding window of 8, so sliding and global layers see different contexts.

Gemma 3 (examples/make_tiny_checkpoint.py "gemma3"): layers 0, 1, 3 slide with rope base 10k, layer 2 is global
with base 1M and linear scaling x8; q/k norms, sandwich norms, 1 + w norm weights, embeddings x sqrt(hidden),
query_pre_attn_scalar 24 (not head_dim 16). Gemma 2 ("gemma2"): alternating layers, attention scores
soft-capped at 50, final logits at 30.
"""
from __future__ import annotations

import json
import shutil

import pytest

import kiln


def test_gemma3_matches_hf(compile_hf, check_hf_parity):
    ckpt, art, _ = compile_hf("gemma3")
    check_hf_parity(art, ckpt, vocab=512, lens=(40,))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecations inside the interpreter
def test_gemma3_h200_artifact_matches_hf(compile_hf, check_prompt_parity, tmp_path):
    """The h200 target's kernels (Triton attention with per-layer windows, rope fused into the KV write with the
    layer's table, Triton norms; torch for the rest) under Triton's CPU interpreter: one prompt of 12 tokens
    (across the window of 8), 4 greedy tokens (interpreted Triton is slow)."""

    from kiln.cli import main

    ckpt, _, _ = compile_hf("gemma3")
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    res = kiln.compile(recipe, tmp_path / "h200", target="h200", progress=False)
    assert {"triton.paged_attention", "triton.rms_norm", "torch.gelu_tanh", "torch.scale"} <= set(res.manifest["kernels"])
    check_prompt_parity(tmp_path / "h200", ckpt, list(range(40, 52)), 4)


def test_gemma3_chat_template_renders_as_hf(compile_hf):
    """The checkpoint's Gemma chat template (BOS in the template, `model` turns, the system message folded into
    the first user turn) renders and encodes in kiln as transformers' apply_chat_template does, and the
    turn's end (<end_of_turn>, from generation_config.json) is a stop token."""
    from transformers import AutoTokenizer

    ckpt, art, _ = compile_hf("gemma3")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is two plus two? "},
                {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"}]
    hf = AutoTokenizer.from_pretrained(ckpt)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is two plus two?<end_of_turn>\n")
    llm = kiln.LLM(str(art))
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == want
    assert tok.encode(want, add_special_tokens=False) == hf.encode(want, add_special_tokens=False)
    eos = json.loads((art / "manifest.json").read_text())["runtime"]["eos_token_ids"]
    assert hf.convert_tokens_to_ids("<end_of_turn>") in eos


def test_gemma3_conditional_generation_text_tower_matches_hf(tiny_checkpoint, compile_hf, tmp_path,
                                                               check_hf_parity, monkeypatch):
    """A Gemma3ForConditionalGeneration checkpoint (text_config, language-model tensors under
    `model.language_model.`, as transformers >= 4.52 saves them): from-hf serves its text tower, which is the
    Gemma3ForCausalLM it was made from."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("gemma3")
    ckpt = tmp_path / "gemma3-mm"
    shutil.copytree(src, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    save_file({name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()},
              ckpt / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**text, "architectures": None}, "vision_config": {"model_type": "siglip_vision_model"}}))
    recipe = tmp_path / "mm.dsl"
    from kiln.cli import main

    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    assert 'prefix="model.language_model."' in recipe.read_text()
    kiln.compile(recipe, tmp_path / "art", progress=False)
    check_hf_parity(tmp_path / "art", src, vocab=512, lens=(17,), new_tokens=8)


def test_gemma2_matches_hf(compile_hf, check_hf_parity):
    ckpt, art, _ = compile_hf("gemma2")
    recipe = (art / "recipe.dsl").read_text()
    assert "attn_softcap=50.0" in recipe and "final_softcap=30.0" in recipe
    check_hf_parity(art, ckpt, vocab=512, lens=(40,), new_tokens=16)


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


@pytest.mark.parametrize("extra,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention = true"),
    ({"hidden_activation": "gelu"}, "hidden_activation = 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "global-layer rope scaling 'yarn'"),
    ({"layer_types": ["sliding_attention"]}, "must list 2 entries"),
])
def test_gemma3_variants_kiln_cannot_compute_are_refused(extra, message, tmp_path):
    from kiln.dsl.errors import KilnError

    from kiln.recipe_from_hf import recipe_from_hf

    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3, **extra}))
    with pytest.raises(KilnError, match=message):
        recipe_from_hf(tmp_path)


def test_gemma3_legacy_config_keys(tmp_path):
    """transformers 4.x configs (Google's on the hub): rope_theta + rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones, sliding_window_pattern instead of layer_types."""
    from kiln.recipe_from_hf import checkpoint_model_args

    cfg = {**GEMMA3, "num_hidden_layers": 7, "rope_theta": 1000000, "rope_local_base_freq": 10000,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024, "sliding_window_pattern": 6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    family, args = checkpoint_model_args(tmp_path)
    assert family == "gemma3"
    assert args["sliding_layers"] == (True,) * 5 + (False, True)
    assert (args["rope_theta"], args["rope_local_theta"], args["rope_scaling"], args["rope_factor"]) == \
        (1e6, 1e4, "linear", 8.0)
    assert args["sliding_window"] == 1024 and args["query_pre_attn_scalar"] == 256.0 and args["tie_embeddings"]
