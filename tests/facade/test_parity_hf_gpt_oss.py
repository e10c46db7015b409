"""gpt-oss end to end against Hugging Face transformers: a random tiny GptOssForCausalLM checkpoint
(examples/make_tiny_checkpoint.py "gpt_oss": 4 layers alternating sliding window 8 and full attention, per-head
attention sinks drawn with std 1, q/k/v/o biases, YaRN x8 over an original context of 64, 4 biased experts top-2
under the clamped SwiGLU with limit 1, so clamps fire) -> `kiln recipe from-hf` -> `kiln compile` (cpu) ->
`kiln.LLM`: fp32 prompt logprobs within 1e-4 of HF and greedy tokens identical (tests/conftest.py
check_hf_parity), on prompts up to 40 tokens, so the window matters.

MXFP4: the same checkpoint with its experts quantized to MXFP4 in OpenAI's layout (`*_blocks` uint8
[E, out, in/32, 16], `*_scales` e8m0 uint8 [E, out, in/32], `quantization_config.quant_method = mxfp4`): kiln
dequantizes at conversion; the converted weights equal transformers' (which, on CPU without the `kernels`
package, loads the checkpoint dequantized) exactly, and the logprobs match transformers running the MXFP4
checkpoint.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import kiln


def test_gpt_oss_matches_hf(compile_hf, check_hf_parity):
    ckpt, art, res = compile_hf("gpt_oss")
    recipe = (art / "recipe.dsl").read_text()
    assert "sliding_layers=[true, false, true, false]" in recipe and 'rope_scaling="yarn"' in recipe
    assert "swiglu_limit=1.0" in recipe
    # the sink attention declines the TVM kernel and runs the torch one, which has the sink logit
    assert "cpu.paged_attention" in res.manifest["kernels"] and "tvm.paged_attention" not in res.manifest["kernels"]
    check_hf_parity(art, ckpt, vocab=512, lens=(5, 17, 40), new_tokens=16)


def test_gpt_oss_sinks_and_clamps_matter(tiny_checkpoint_lib, tiny_checkpoint):
    """The tiny checkpoint exercises what the test claims: zeroing the sinks or lifting the clamp changes HF's
    logits well beyond the parity tolerance (a kiln that ignored either would fail the parity test)."""
    ckpt = tiny_checkpoint("gpt_oss")
    model = tiny_checkpoint_lib.load_hf_model(ckpt)
    ids = torch.randint(5, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        no_sinks = model(ids).logits
        for layer, s in zip(model.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(s)
        for layer in model.model.layers:
            layer.mlp.experts.limit = 1e9
        no_clamp = model(ids).logits
    assert (base - no_sinks).abs().max() > 1e-2
    assert (base - no_clamp).abs().max() > 1e-2


def _mxfp4_checkpoint(src, dst):
    """`src` with its experts quantized to MXFP4 in OpenAI's layout (and config), and the experts' exact
    dequantization, [E, in, out] as transformers holds them."""
    from kiln.compiler.quant import mxfp4_dequantize, mxfp4_quantize
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.transpose(-1, -2))  # [E, in, out] -> the format's [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized[name] = mxfp4_dequantize(blocks, scales).transpose(-1, -2).float()
        else:
            packed[name] = t
    save_file(packed, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def test_mxfp4_round_trip_matches_transformers_dequantization():
    """kiln's MXFP4 decoding is transformers' (integrations/mxfp4.py convert_moe_packed_tensors), value for value;
    the test helper's quantization rounds to the nearest grid value and keeps values already on the grid."""
    from kiln.compiler.quant import mxfp4_dequantize, mxfp4_quantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 64, generator=g) * torch.logspace(-3, 2, 8)[None, :, None]  # [E, out, in]
    blocks, scales = mxfp4_quantize(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    ours = mxfp4_dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    torch.testing.assert_close(ours.float(), theirs.transpose(1, 2), atol=0, rtol=0)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # e2m1's widest gap is 2 steps
    assert ((ours.float() - w).abs() <= step).all()  # nearest: within half the widest gap
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(ours.float())), ours)  # values on the grid stay


@pytest.mark.filterwarnings("ignore")  # transformers: no `kernels` package, MXFP4 dequantized on CPU
def test_gpt_oss_mxfp4_experts_load_dequantized(tiny_checkpoint, tiny_checkpoint_lib, check_prompt_parity, tmp_path):
    """transformers loads the MXFP4 checkpoint on CPU by dequantizing it (its MXFP4 kernels need the `kernels`
    package and a GPU): kiln's converted experts equal its weights and our dequantization exactly, and kiln's
    logprobs and greedy tokens match it running that checkpoint."""
    from safetensors.torch import load_file

    from kiln.cli import main

    ckpt = tmp_path / "mxfp4"
    dequantized = _mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), ckpt)
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    assert "quantize" not in recipe.read_text()  # served dequantized: no weight scheme to apply
    kiln.compile(recipe, tmp_path / "art", progress=False)
    weights = {}
    for f in sorted((tmp_path / "art" / "weights" / "rank0").glob("*.safetensors")):
        weights.update(load_file(f))
    hf = tiny_checkpoint_lib.load_hf_model(ckpt)
    for i, layer in enumerate(hf.model.layers):
        for ours, theirs in (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj")):
            want = dequantized[f"model.layers.{i}.mlp.experts.{theirs}"]
            assert torch.equal(getattr(layer.mlp.experts, theirs).detach(), want)
            assert torch.equal(weights[f"decoder.{i}.{ours}"], want.transpose(-1, -2))
    g = torch.Generator().manual_seed(2)
    check_prompt_parity(tmp_path / "art", ckpt, torch.randint(5, 512, (40,), generator=g).tolist(), 16)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecations inside the interpreter
def test_gpt_oss_h200_artifact_matches_hf(compile_hf, check_prompt_parity, tmp_path):
    """The h200 target: the Triton attention with its sink logits (and the rope fused into the KV write), the
    experts on torch (biases, clamped SwiGLU); under Triton's CPU interpreter, one prompt of 12 tokens across the
    window of 8, 4 greedy tokens (decode steps: the Triton decode kernel)."""
    from kiln.cli import main

    ckpt, _, _ = compile_hf("gpt_oss")
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    res = kiln.compile(recipe, tmp_path / "h200", target="h200", progress=False)
    kernels = set(res.manifest["kernels"])
    assert "triton.paged_attention" in kernels and "torch.paged_attention" not in kernels
    check_prompt_parity(tmp_path / "h200", ckpt, list(range(40, 52)), 4)


GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
           "num_local_experts": 4, "num_experts_per_tok": 2}


def test_gpt_oss_config_defaults(tmp_path):
    """OpenAI-style configs leave keys to GptOssConfig's defaults: every other layer slides from the first (window
    128), YaRN x32 over 4096 positions without truncation, rope base 150k, swiglu alpha 1.702 / limit 7."""
    from kiln.recipe_from_hf import checkpoint_model_args

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS))
    family, args = checkpoint_model_args(tmp_path)
    assert family == "gpt_oss"
    assert args["sliding_layers"] == (True, False, True) and args["sliding_window"] == 128
    assert (args["rope_scaling"], args["rope_factor"], args["rope_original_max_position"], args["rope_theta"],
            args["rope_truncate"]) == ("yarn", 32.0, 4096, 150000.0, False)
    assert (args["experts"], args["top_k"], args["ffn"], args["head_dim"]) == (4, 2, 32, 16)
    assert "swiglu_limit" not in args  # the model's default, 7.0, as GptOssConfig's


@pytest.mark.parametrize("extra,message", [
    ({"attention_bias": False}, "attention_bias = false"),
    ({"layer_types": ["sliding_attention"]}, "must list 3 entries"),
    ({"sliding_window": None}, "must be a positive window"),
])
def test_gpt_oss_variants_kiln_cannot_compute_are_refused(extra, message, tmp_path):
    from kiln.dsl.errors import KilnError

    from kiln.recipe_from_hf import recipe_from_hf

    (tmp_path / "config.json").write_text(json.dumps({**GPT_OSS, **extra}))
    with pytest.raises(KilnError, match=message):
        recipe_from_hf(tmp_path)


def test_transposed_param_reads_the_checkpoint_tensor_swapped(tmp_path):
    """`from "t" transposed`: the declared shape is the checkpoint's with the last two dims swapped; a tensor stored
    unswapped is a located error naming the shape it needs."""
    from kiln.codegen.errors import WeightError
    from kiln.codegen.weights import convert_weights
    from kiln.compiler.instantiate import instantiate_model
    from kiln.dsl import load_file as load_dsl
    from safetensors.torch import load_file, save_file

    (tmp_path / "m.dsl").write_text(
        'model m() {\n  param w: [3, 4] from "w" transposed\n  param e: [5, 4] from "e"\n'
        '  param lm: [5, 3] from "lm"\n  forward(tokens) { return logits(linear(embedding(tokens, e), w), lm) }\n}\n')
    (model,) = load_dsl(tmp_path / "m.dsl").models
    program = instantiate_model(model, {})
    assert program.params["w"].transposed
    w, rest = torch.arange(12.0).reshape(4, 3), {"e": torch.ones(5, 4), "lm": torch.ones(5, 3)}
    save_file({"w": w, **rest}, tmp_path / "model.safetensors")
    convert_weights(program, tmp_path, tmp_path / "art", progress=False)
    got = load_file(next((tmp_path / "art" / "weights" / "rank0").glob("*.safetensors")))
    assert torch.equal(got["w"], w.t())
    save_file({"w": w.t().contiguous(), **rest}, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"'w' has shape \[3, 4\], but param 'w' expects \[4, 3\] \(its \[3, 4\] stored transposed\)"):
        convert_weights(program, tmp_path, tmp_path / "art2", progress=False)


def test_gpt_oss_experts_split_by_width_are_refused(tiny_checkpoint, tmp_path):
    """tp = 2 alone splits every expert's width over the ranks, and each would add the expert's down bias: refused
    at the recipe's parallel line, naming the fix (whole experts per rank: tests/parallel's tp = 2; ep = 2 case)."""
    from kiln.dsl.errors import KilnError

    from kiln.recipe_from_hf import recipe_from_hf

    recipe = tmp_path / "r.dsl"
    text = recipe_from_hf(tiny_checkpoint("gpt_oss"), out_file=recipe)
    recipe.write_text(text.replace("  serve ", "  parallel  { tp = 2 }\n  serve ", 1))
    with pytest.raises(KilnError, match=r"expert biases \(gpt-oss\) need whole experts on each rank.*set ep to"):
        kiln.compile(recipe, tmp_path / "art", progress=False)
