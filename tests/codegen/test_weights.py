"""Weight conversion: HF safetensors checkpoints (single, sharded, any set) or a seed -> artifact shards."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from codegen_helpers import FFN, HIDDEN, KV, Q, checkpoint_tensors, make_program
from kiln.codegen import CheckpointError, WeightError, convert_weights
from kiln.dsl.errors import KilnError, Loc, register_source
from safetensors import safe_open
from safetensors.torch import load_file

DSL = "tiny.dsl"
register_source(DSL, "model tiny() {\n  block decoder[2] {\n    param wqkv: [64, 32] from \"...\"\n  }\n}\n")
WQKV_LOC = Loc(DSL, 3, 5, 10)


def located(program, name, loc):
    return program.with_params({**program.params, name: dataclasses.replace(program.params[name], loc=loc)})


def read_all(wdir, files):
    out = {}
    for f in files:
        out |= load_file(str(wdir / f))
    return out


def test_single_file_and_sharded_checkpoints_convert_identically(ckpt_factory, tmp_path):
    program = make_program()
    outs = {}
    for label, kw in {"single": {}, "sharded": {"shards": 3}, "no_index": {"shards": 2, "index": False}}.items():
        files = convert_weights(program, ckpt_factory(label, **kw), tmp_path / f"out_{label}", progress=False)
        assert files == ["model-00001-of-00001.safetensors"]
        outs[label] = (tmp_path / f"out_{label}" / "weights/rank0" / files[0]).read_bytes()
    assert outs["single"] == outs["sharded"] == outs["no_index"]


def test_fused_params_are_concatenated_and_named_per_layer(ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    files = convert_weights(make_program(), ckpt_factory(), tmp_path, progress=False)
    w = read_all(tmp_path / "weights/rank0", files)
    assert "decoder.1.wqkv" in w and "embed" in w and "lm_head" in w and len(w) == 3 + 2 * 7
    p = "model.layers.1.self_attn"
    expected = torch.cat([tensors[f"{p}.q_proj.weight"], tensors[f"{p}.k_proj.weight"], tensors[f"{p}.v_proj.weight"]])
    assert torch.equal(w["decoder.1.wqkv"], expected) and w["decoder.1.wqkv"].shape == (Q + 2 * KV, HIDDEN)
    assert torch.equal(w["decoder.0.w_gate_up"][FFN:], tensors["model.layers.0.mlp.up_proj.weight"])


def test_output_is_sharded_deterministically(ckpt_factory, tmp_path):
    program, ckpt = make_program(), ckpt_factory()
    files = convert_weights(program, ckpt, tmp_path / "a", progress=False, max_shard_bytes=20_000)
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    whole = convert_weights(program, ckpt, tmp_path / "b", progress=False)
    assert read_all(tmp_path / "a/weights/rank0", files).keys() == read_all(tmp_path / "b/weights/rank0", whole).keys()
    again = convert_weights(program, ckpt, tmp_path / "c", progress=False, max_shard_bytes=20_000)
    for f in files:
        assert (tmp_path / "a/weights/rank0" / f).read_bytes() == (tmp_path / "c/weights/rank0" / f).read_bytes()
    with safe_open(str(tmp_path / "a/weights/rank0" / files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert again == files


def test_cast_to_program_dtype(ckpt_factory, tmp_path):
    files = convert_weights(make_program(dtype="bf16"), ckpt_factory(), tmp_path, progress=False)
    w = read_all(tmp_path / "weights/rank0", files)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert torch.equal(w["embed"], checkpoint_tensors()["model.embed_tokens.weight"].to(torch.bfloat16))


def test_missing_tensor_names_tensor_param_and_declaration(ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    program = located(make_program(), "decoder.wqkv", WQKV_LOC)
    with pytest.raises(WeightError) as e:
        convert_weights(program, ckpt_factory(tensors=tensors), tmp_path / "out", progress=False)
    msg = str(e.value)
    assert msg.startswith("tiny.dsl:3:5: ")
    assert "'model.layers.1.self_attn.k_proj.weight'" in msg and "param 'decoder.wqkv' (layer 1)" in msg
    assert isinstance(e.value, KilnError) and e.value.loc == WQKV_LOC
    assert "param wqkv" in e.value.format() and "^~~~~" in e.value.format()  # quotes the DSL line
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_misspelled_source_suggests_the_closest_tensor(ckpt_factory, tmp_path):
    program = make_program()
    spec = program.params["norm"]
    program = program.with_params({**program.params, "norm": dataclasses.replace(spec, source=("model.nrom.weight",))})
    with pytest.raises(WeightError, match="model.nrom.weight") as e:
        convert_weights(program, ckpt_factory(), tmp_path, progress=False)
    assert e.value.notes == ("did you mean 'model.norm.weight'?",)


def test_wrong_shape_names_expected_and_actual(ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    tensors["model.norm.weight"] = torch.ones(HIDDEN + 1)
    program = located(make_program(), "norm", Loc(DSL, 1, 1))
    with pytest.raises(WeightError) as e:
        convert_weights(program, ckpt_factory(tensors=tensors), tmp_path, progress=False)
    assert str(e.value) == ("tiny.dsl:1:1: checkpoint tensor 'model.norm.weight' has shape [33], but param 'norm' "
                            "expects [32]")


def test_wrong_shape_inside_a_fused_param(ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(KV, HIDDEN + 2)
    program = located(make_program(), "decoder.wqkv", WQKV_LOC)
    with pytest.raises(WeightError, match=r"'model.layers.0.self_attn.v_proj.weight' has shape \[16, 34\].*"
                                          r"param 'decoder.wqkv' \(layer 0\).*\[64, 32\].*needs \[\*, 32\]"):
        convert_weights(program, ckpt_factory(tensors=tensors), tmp_path, progress=False)
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(KV + 1, HIDDEN)
    with pytest.raises(WeightError, match=r"concatenate along dim 0 to 65, but param 'decoder.wqkv' \(layer 0\) "
                                          r"expects \[64, 32\]"):
        convert_weights(program, ckpt_factory("c2", tensors=tensors), tmp_path, progress=False)


def test_bad_checkpoint_directories(tmp_path):
    program = make_program()
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_weights(program, tmp_path / "nope", tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        convert_weights(program, tmp_path / "empty", tmp_path / "out", progress=False)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken/model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        convert_weights(program, tmp_path / "broken", tmp_path / "out", progress=False)


def test_random_weights_are_deterministic_and_shaped_like_an_init(tmp_path):
    program = make_program(layers=2)
    files = convert_weights(program, None, tmp_path / "a", seed=0, progress=False)
    convert_weights(program, None, tmp_path / "b", seed=0, progress=False)
    convert_weights(program, None, tmp_path / "c", seed=1, progress=False)
    a, b, c = (tmp_path / d / "weights/rank0" / files[0] for d in "abc")
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    w = load_file(str(a))
    assert torch.equal(w["decoder.0.attn_norm"], torch.ones(HIDDEN)) and torch.equal(w["norm"], torch.ones(HIDDEN))
    assert torch.equal(w["decoder.1.bqkv"], torch.zeros(Q + 2 * KV))  # read as a linear bias
    assert abs(w["embed"].std().item() - 0.02) < 0.003 and not torch.equal(w["decoder.0.wo"], w["decoder.1.wo"])
    # a tensor's values depend on its name and the seed only, not on the rest of the program
    one_layer = load_file(str(tmp_path / "d/weights/rank0" /
                              convert_weights(make_program(layers=1), None, tmp_path / "d", progress=False)[0]))
    assert torch.equal(one_layer["decoder.0.wo"], w["decoder.0.wo"])


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 16, "half", "header"])
def test_truncated_empty_or_garbage_checkpoint_files_are_checkpoint_errors(ckpt_factory, tmp_path, content):
    """A broken safetensors file is a CheckpointError naming it, not safetensors' raw SafetensorError."""
    ckpt = ckpt_factory("broken_file")
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    cut = {"half": data[: len(data) // 2], "header": data[:100]}
    file.write_bytes(cut.get(content, content) if isinstance(content, str) else content)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        convert_weights(make_program(), ckpt, tmp_path / "out", progress=False)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/hostname", "sub/../../outside.safetensors"])
def test_a_shard_index_cannot_name_files_outside_its_checkpoint(ckpt_factory, tmp_path, target):
    ckpt = ckpt_factory("escape")
    outside = ckpt.parent / "outside.safetensors"
    outside.write_bytes((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": target}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        convert_weights(make_program(), ckpt, tmp_path / "out", progress=False)


def test_a_shard_index_of_the_wrong_shape_is_a_checkpoint_error(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck/model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        convert_weights(make_program(), tmp_path / "ck", tmp_path / "out", progress=False)


def _e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_fp8_checkpoint_tensors_into_float_params_are_dequantized_with_their_scales(ckpt_factory, tmp_path):
    """An unquantized param reading an e4m3 checkpoint tensor (DeepSeek-V3's and the FP8 MoE checkpoints'
    experts: quantize_weights leaves 3-D expert weights float) gets codes x scale, not the codes: per row
    (`_scale` [N, 1]), per tensor (`_scale` [1]) and 16x16 blocks (`_scale_inv`); the rest stays as it was."""
    tensors = checkpoint_tensors()
    p = "model.layers.0.self_attn"
    q, k, v = (tensors[f"{p}.{m}_proj.weight"] for m in "qkv")
    q_s = q.abs().amax(1, keepdim=True) / 448
    v_s = (v.abs().amax() / 448).reshape(1)
    k_s = torch.stack([k[i:i + 16, j:j + 16].abs().amax() / 448 for i in range(0, KV, 16)
                       for j in range(0, HIDDEN, 16)]).reshape(-(-KV // 16), HIDDEN // 16)
    k_full = k_s.repeat_interleave(16, 0)[:KV].repeat_interleave(16, 1)[:, :HIDDEN]
    tensors |= {f"{p}.q_proj.weight": _e4m3(q, q_s), f"{p}.q_proj.weight_scale": q_s,
                f"{p}.k_proj.weight": _e4m3(k, k_full), f"{p}.k_proj.weight_scale_inv": k_s,
                f"{p}.v_proj.weight": _e4m3(v, v_s), f"{p}.v_proj.weight_scale": v_s}
    files = convert_weights(make_program(), ckpt_factory(tensors=tensors), tmp_path, progress=False)
    w = read_all(tmp_path / "weights/rank0", files)["decoder.0.wqkv"]
    want = torch.cat([_e4m3(q, q_s).float() * q_s, _e4m3(k, k_full).float() * k_full, _e4m3(v, v_s).float() * v_s])
    assert torch.equal(w, want)
    assert (w - torch.cat([q, k, v])).abs().max() < 0.05  # and close to the float weights they quantize


@pytest.mark.parametrize("tensor, message", [
    (lambda w: (w.to(torch.float8_e4m3fn), None), "is fp8 but has no scale"),
    (lambda w: (w.to(torch.int8), None), "is int8, but param 'decoder.wqkv' is f32 and reads it unquantized"),
    (lambda w: (w.to(torch.float8_e4m3fn), torch.ones(3, 5)), r"has shape \[3, 5\], which is no per-tensor"),
])
def test_quantized_checkpoint_tensors_a_float_param_cannot_read_are_errors(tensor, message, ckpt_factory, tmp_path):
    tensors = checkpoint_tensors()
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name], scale = tensor(tensors[name])
    if scale is not None:
        tensors[name + "_scale"] = scale
    with pytest.raises(WeightError, match=message):
        convert_weights(make_program(), ckpt_factory(tensors=tensors), tmp_path, progress=False)
