"""Gemma's IR: the bundled gemma3/gemma2 models under the reference interpreter against transformers (per-layer
windows and ropes, 1 + w norm weights as the converter stores them, soft-capping), the residual-add fusion on
sandwich norms (before/after IR and numerics), the IR text form of per-layer attributes and param offsets, and
per_layer's errors."""
from __future__ import annotations

import pytest
import torch
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.interpret import interpret
from kiln.compiler.ir import PerLayer
from kiln.compiler.text import parse_program, print_program
from kiln.dsl import load_recipe
from kiln.dsl.errors import SourceError
from kiln.passes.fuse_add_rms_norm import FuseAddRMSNorm
from kiln.passes.shape_inference import ShapeInference
from pass_testlib import logits_before_after, run_pass

transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "max_position_embeddings": 128,
         "sliding_window": 4, "query_pre_attn_scalar": 12, "layer_types":
         ["sliding_attention", "full_attention", "sliding_attention"]}
DSL = ("vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, ffn=48, sliding_window=4, "
       "query_pre_attn_scalar=12.0, sliding_layers=[true, false, true]")
CASES = {
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", ', rope_scaling="linear", rope_factor=4.0',
               {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", ", attn_softcap=1.5, final_softcap=2.0",
               {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}),
}


def _program(tmp_path, name: str, args: str):
    path = tmp_path / "r.dsl"
    path.write_text(f"recipe r {{ model = {name}({args}) }}\n")
    loaded = load_recipe(str(path))
    return instantiate_model(loaded.model, dict(loaded.model_call.kwargs))


@pytest.mark.parametrize("name", list(CASES))
def test_bundled_gemma_matches_hf_in_the_interpreter(name, tmp_path):
    model_cls, config_cls, dsl_args, hf_args = CASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SHAPE, **hf_args, attn_implementation="eager")
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)  # HF zero-inits the norms (1 + 0): random values make every 1 + w matter
    state = hf.state_dict()
    program = _program(tmp_path, name, DSL + dsl_args)
    weights = {}
    for spec in program.params.values():
        block = program.blocks[spec.block] if spec.block else None
        for i in range(block.count) if block else [None]:
            (src,) = spec.sources_for(block.global_layer(i) if block else None)
            weights[spec.layer_name(i)] = state[src] + spec.offset  # as codegen/weights.py converts
    assert program.params["norm"].offset == 1.0 and program.params["embed"].offset == 0.0
    tokens = torch.randint(0, 64, (11,))  # longer than the window of 4
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    torch.testing.assert_close(interpret(program, weights, tokens), ref, atol=1e-4, rtol=1e-4)


def test_sandwich_norms_fuse_only_the_pre_mlp_norm(tmp_path):
    """Each layer: h + post_attn_norm(o_proj) feeds pre_feedforward_norm -> one add_rms_norm (the sum is the
    residual); the post norms read GEMM outputs, not residual sums, and stay rms_norm; the layer's last add
    (h + post_mlp_norm(down)) feeds the next layer's input norm in the next call, so it stays an add."""
    program = _program(tmp_path, "gemma3", DSL)
    typed, _ = run_pass(ShapeInference(), program)
    after, ctx = run_pass(FuseAddRMSNorm(), typed)
    block = after.graphs["decoder"]
    assert block.count("add_rms_norm") == 1 and block.count("rms_norm") == 5 and block.count("add") == 1
    fused = next(n for _, n in block.items() if n.op == "add_rms_norm")
    assert fused.inputs[2] == "mlp_norm"  # the pre-feedforward norm's weight
    post = [block.node(block.node(v).inputs[0]).op for v, n in block.items() if n.op == "rms_norm"
            and block.node(n.inputs[1]).attrs["name"] in ("decoder.post_attn_norm", "decoder.post_mlp_norm")]
    assert post == ["linear", "linear"]
    ref, got = logits_before_after(typed, after)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_per_layer_attributes_and_offsets_print_and_parse(tmp_path):
    program = _program(tmp_path, "gemma3", DSL)
    attention = next(n for _, n in program.graphs["decoder"].items() if n.op == "attention")
    assert attention.attrs["sliding_window"] == PerLayer((4, 0, 4))
    rope = next(n for _, n in program.graphs["decoder"].items() if n.op == "rope")
    assert rope.attrs["theta"] == PerLayer((10000.0, 1000000.0, 10000.0))
    text = print_program(program)
    assert '{"per_layer": [4, 0, 4]}' in text and "offset=1.0" in text
    again = parse_program(text)
    assert print_program(again) == text and again.params["decoder.attn_norm"].offset == 1.0


def test_per_layer_values_the_same_everywhere_are_plain(tmp_path):
    program = _program(tmp_path, "gemma3", DSL.replace("[true, false, true]", "[true, true, true]"))
    attention = next(n for _, n in program.graphs["decoder"].items() if n.op == "attention")
    assert attention.attrs["sliding_window"] == 4


def test_per_layer_mask_of_the_wrong_length_is_located(tmp_path):
    with pytest.raises(SourceError, match="per_layer's mask has 2 entries; block 'decoder' has 3 layers") as e:
        _program(tmp_path, "gemma3", DSL.replace("[true, false, true]", "[true, false]"))
    assert e.value.loc.file.endswith("gemma3.dsl")


def test_negative_attention_softcap_is_located(tmp_path):
    with pytest.raises(SourceError, match="attention softcap must be a number >= 0") as e:
        _program(tmp_path, "gemma2", DSL + ", attn_softcap=-1.0")
    assert e.value.loc.file.endswith("gemma2.dsl")
