"""Static fp8 activation scales (FP8 W8A8 static, llm-compressor's most common FP8 recipe) on a tiny random Llama:

* a compressed-tensors checkpoint written here (e4m3 weights, `weight_scale`, `input_scale`, config.json
  `quantization_config` as llm-compressor saves it) goes through `kiln recipe from-hf` + compile, and its
  logits are those of an independent torch static-W8A8 model (transformers' Llama with every projection
  replaced by: quantize x with the given scale, saturating; e4m3 products in fp32; times both scales);
* q/k/v input scales that differ are merged into their max — the reference with the max gives the same
  logits, and the deviation from per-projection scales is bounded;
* a missing `input_scale` is refused with its name; a float checkpoint is calibrated at compile time;
* the manifest's `weights.total_bytes` counts a tensor stored once (an alias) once.
"""
from __future__ import annotations

import json

import pytest
import torch
from kiln.codegen.errors import WeightError
from kiln.dsl.errors import KilnError
from quant_testlib import LINEARS, build, fp8_reference, kl, log_probs, rewrite_checkpoint
from safetensors import safe_open

import kiln
from kiln.cli import main

E4M3_MAX = 448.0
KL_BOUND = 0.05  # as fp8(act=dynamic): measured 0.029 (calibrated) — docs/quantization.md


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("quant_static")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(5, 512, (32,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def hf_model(ckpt, tiny_checkpoint_lib):
    return tiny_checkpoint_lib.load_hf_model(ckpt)


def _input_absmax(model, tokens) -> dict[str, float]:
    """absmax of every projection's input over `tokens` (forward pre-hooks on the float model): the scales a
    minmax observer would calibrate."""
    seen: dict[str, float] = {}
    hooks = [mod.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(
        name, max(seen.get(name, 0.0), float(args[0].abs().max()))))
        for name, mod in model.named_modules() if any(name.endswith(lin) for lin in LINEARS)]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return seen


def _llm_compressor_config(strategy: str) -> dict:
    """quantization_config in the layout llm-compressor writes for FP8 W8A8 static (QuantizationModifier
    scheme "FP8"): one config group over Linear, static per-tensor float8 input activations."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                          "weights": {**args, "strategy": strategy, "dynamic": False},
                                          "input_activations": {**args, "strategy": "tensor", "dynamic": False}}}}


def _static_checkpoint(ckpt, dst, input_scales: dict[str, float], strategy: str = "tensor", drop: str = ""):
    """ckpt with every projection in e4m3 + weight_scale + input_scale (module name -> scale), as
    compressed-tensors saves it; `drop` leaves out that input_scale tensor."""
    def quantize(tensors):
        out = dict(tensors)
        for name in [n for n in tensors if n.endswith("_proj.weight")]:
            stem = name[: -len(".weight")]
            out[name], out[f"{stem}.weight_scale"] = fp8_reference(tensors[name], strategy)
            if f"{stem}.input_scale" != drop:
                out[f"{stem}.input_scale"] = torch.tensor([input_scales[stem]])
        return out

    dst = rewrite_checkpoint(ckpt, dst, quantize)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = _llm_compressor_config(strategy)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _from_hf(ckpt, out):
    recipe = out.parent / f"{out.name}.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    kiln.compile(recipe, out, progress=False)
    return recipe.read_text()


@torch.no_grad()
def _static_reference(model, qckpt, tokens, scale_of=None) -> torch.Tensor:
    """log-probs of the static W8A8 model: each projection y = (e4m3(x / s_x) @ w_q.T) · s_x · s_w, computed
    here from the checkpoint's tensors (`scale_of(module name, s_x)` may replace a projection's s_x; None:
    x is not quantized, weight-only fp8)."""
    f = safe_open(str(qckpt / "model.safetensors"), framework="pt")
    saved = {}
    for name, mod in model.named_modules():
        if not any(name.endswith(lin) for lin in LINEARS):
            continue
        w_q, s_w = f.get_tensor(f"{name}.weight").float(), f.get_tensor(f"{name}.weight_scale").float().reshape(1, -1)
        s_x = float(f.get_tensor(f"{name}.input_scale"))
        s_x = scale_of(name, s_x) if scale_of else s_x

        def forward(x, w_q=w_q, s_w=s_w, s_x=s_x):
            if s_x is None:
                return (x.float() @ w_q.T) * s_w
            x_q = (x.float() / s_x).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
            return (x_q @ w_q.T) * s_x * s_w

        saved[mod] = mod.forward
        mod.forward = forward
    try:
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    finally:
        for mod, fwd in saved.items():
            mod.forward = fwd


@pytest.fixture(scope="module")
def scales(hf_model, tokens):
    # 0.8 x the observed absmax: the largest activations saturate at ±448, so the clamp is exercised too
    return {name: 0.8 * a / E4M3_MAX for name, a in _input_absmax(hf_model, tokens).items()}


@pytest.mark.parametrize("strategy,recipe", [("tensor", "fp8(act=static)"),
                                             ("channel", "fp8(per_channel=true, act=static)")])
def test_static_checkpoint_from_hf_matches_torch_reference(strategy, recipe, ckpt, work, tokens, hf_model, scales):
    qckpt = _static_checkpoint(ckpt, work / f"ckpt_{strategy}", scales, strategy)
    text = _from_hf(qckpt, work / f"static_{strategy}")
    assert f"quantize  {{ weights = {recipe} }}" in text
    got = log_probs(work / f"static_{strategy}", tokens)
    ref = _static_reference(hf_model, qckpt, tokens)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)
    # the activations are quantized: weight-only fp8 of the same checkpoint is far outside that tolerance
    weight_only = _static_reference(hf_model, qckpt, tokens, scale_of=lambda name, s: None)
    print(f"max |static - weight-only| {(weight_only - ref).abs().max():.4f}, kiln vs reference "
          f"{(got - ref).abs().max():.2e}")
    assert (weight_only - ref).abs().max() > 1e-2
    manifest = json.loads((work / f"static_{strategy}" / "manifest.json").read_text())
    assert any(p["name"] == "decoder.wqkv_input_scale" for p in manifest["params"])  # q/k/v merged


def test_different_qkv_input_scales_merge_into_their_max(ckpt, work, tokens, hf_model, scales):
    """q, k and v read one x, so the merged GEMM quantizes it once with max(s_q, s_k, s_v). Here the k and v
    scales are 1.5x and 2x q's: kiln gives the max-scale reference exactly, and stays close to per-projection."""
    bumped = {n: s * (1.5 if n.endswith("k_proj") else 2.0 if n.endswith("v_proj") else 1.0)
              for n, s in scales.items()}
    qckpt = _static_checkpoint(ckpt, work / "ckpt_bumped", bumped)
    _from_hf(qckpt, work / "static_bumped")
    got = log_probs(work / "static_bumped", tokens)

    def qkv_max(name, s):
        if "self_attn" not in name or name.endswith("o_proj"):
            return s
        layer = name.rsplit(".", 1)[0]
        return max(bumped[f"{layer}.{p}"] for p in ("q_proj", "k_proj", "v_proj"))

    torch.testing.assert_close(got, _static_reference(hf_model, qckpt, tokens, scale_of=qkv_max), rtol=0, atol=2e-4)
    per_projection = _static_reference(hf_model, qckpt, tokens)
    with torch.no_grad():
        exact = hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    # q's x on a 2x (k's 1.33x) coarser grid: a deviation well below the W8A8 quantization's own error
    deviation, quant_error = kl(per_projection, got), kl(exact, per_projection)
    print(f"KL(per-projection || merged max) {deviation:.4f}, KL(fp32 || static W8A8) {quant_error:.4f}")
    assert deviation < 0.5 * quant_error


def test_missing_input_scale_is_refused_with_its_name(ckpt, work, scales):
    qckpt = _static_checkpoint(ckpt, work / "ckpt_missing", scales,
                               drop="model.layers.1.self_attn.o_proj.input_scale")
    with pytest.raises(WeightError, match=r"'model\.layers\.1\.self_attn\.o_proj\.input_scale'") as e:
        _from_hf(qckpt, work / "static_missing")
    assert "fp8(act=static)" in str(e.value) and "fp8(act=dynamic)" in e.value.format()


@pytest.mark.parametrize("quantize,bound", [("weights = fp8(act=static)", KL_BOUND),
                                            ("weights = fp8(act=static); kv_cache = fp8", KL_BOUND + 0.012)],
                         ids=["static", "static+kv"])
def test_static_on_float_checkpoint_is_calibrated_and_bounded(quantize, bound, ckpt, work, tokens):
    """A float checkpoint has no input scales: they are calibrated at compile time (before the fp8 KV scales,
    when those are calibrated too)."""
    base = log_probs(build(ckpt, work / "base"), tokens)
    art = build(ckpt, work / f"calibrated_{len(quantize)}", quantize)
    assert kl(base, log_probs(art, tokens)) < bound
    f = safe_open(str(next((art / "weights" / "rank0").glob("*.safetensors"))), framework="pt")
    xs = [float(f.get_tensor(n)) for n in f.keys() if n.endswith("_input_scale")]  # noqa: SIM118
    assert len(xs) == 2 * 4 and all(s > 0 for s in xs)  # qkv, o, gate_up, down per layer, each calibrated
    assert len(set(xs)) == len(xs)


def test_static_scheme_options_are_checked(ckpt, work):
    with pytest.raises(KilnError, match="not act=static"):
        build(ckpt, work / "bad_block", "weights = fp8(block=128, act=static)")
    with pytest.raises(KilnError, match="none .weight-only., dynamic .* or static"):
        build(ckpt, work / "bad_act", "weights = fp8(act=sometimes)")


def test_manifest_total_bytes_counts_aliased_tensors_once(ckpt, work):
    """An lm_head equal to the embedding (untied in config) is stored once: total_bytes is what the shards hold."""
    copy = rewrite_checkpoint(ckpt, work / "ckpt_alias",
                              lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    art = build(copy, work / "alias")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["weights"]["aliases"] == {"lm_head": "embed"}
    stored = 0
    for file in manifest["weights"]["files"]:
        with safe_open(str(art / manifest["weights"]["dir"] / file), framework="pt") as f:
            stored += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys())  # noqa: SIM118
    assert manifest["weights"]["total_bytes"] == stored


@pytest.mark.parametrize("weights,acts,expected", [
    ({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}, "fp8(act=static)"),
    ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}, "fp8(per_channel=true, act=dynamic)"),
    ({"strategy": "block", "block_structure": [128, 128]}, {"strategy": "group", "dynamic": True},
     "fp8(block=128, act=dynamic)"),
    ({"strategy": "channel"}, None, "fp8(per_channel=true)"),
])
def test_from_hf_maps_compressed_tensors_fp8_configs(weights, acts, expected):
    from kiln.recipe_from_hf import _weight_quantization

    cfg = _llm_compressor_config("tensor")
    group = cfg["config_groups"]["group_0"]
    group["weights"].update(weights)
    group["input_activations"] = None if acts is None else {**group["input_activations"], **acts}
    assert _weight_quantization({"quantization_config": cfg}) == expected


def test_from_hf_refuses_other_compressed_tensors_formats():
    from kiln.recipe_from_hf import UnsupportedCheckpoint, _weight_quantization

    cfg = _llm_compressor_config("channel")
    cfg["format"] = "pack-quantized"
    cfg["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
    cfg["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(UnsupportedCheckpoint, match="4-bit int weights; kiln reads its FP8"):
        _weight_quantization({"quantization_config": cfg})


@pytest.mark.parametrize("config,expected", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "fp8(block=128, act=dynamic)"),  # DeepSeek-V3 / Qwen3-FP8
    ({"quant_method": "fp8"}, "fp8(block=128, act=dynamic)"),  # transformers' FineGrainedFP8Config defaults
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq(group=128)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
     "gptq(group=32, sym=false)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
     "gptq(group=128, sym=true, format=v2)"),
])
def test_from_hf_maps_fp8_awq_gptq_configs(config, expected):
    from kiln.recipe_from_hf import _weight_quantization

    assert _weight_quantization({"quantization_config": config}) == expected


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method = 'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits = 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size = -1"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
])
def test_from_hf_refuses_quantized_checkpoints_it_cannot_read(config, message):
    from kiln.recipe_from_hf import UnsupportedCheckpoint, _weight_quantization

    with pytest.raises(UnsupportedCheckpoint, match=message):
        _weight_quantization({"quantization_config": config})
