"""MoE in the IR: the routing dtype contract in the verifier, `{e}` expert stacks from DSL to weight conversion,
the fuse_expert_gate_up pass (before/after IR, numerics), from-hf, and the report's active bytes."""
from __future__ import annotations

import json

import pytest
import torch
from kiln.codegen.weights import convert_weights
from kiln.compiler import PassContext, assert_graphs_equal, parse_program, verify_program
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.ir import Attrs, Node
from kiln.compiler.ops import OPS, ShapeError
from kiln.compiler.verifier import VerifyError
from kiln.dsl import load_file
from kiln.dsl.errors import SourceError
from kiln.passes.fuse_expert_gate_up import FuseExpertGateUp
from kiln.passes.shape_inference import ShapeInference, ShapeInferenceError
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.recipe_from_hf import UnsupportedCheckpoint, recipe_from_hf

E, F_, H = 4, 6, 8

MOE = """
program p dtype=f32 {{
  config {{}}
  param router: f32[{E}, {H}] from ["gate.weight"]
  param w_gate: f32[{E}, {F}, {H}] from ["experts.{{e}}.w1.weight"]
  param w_up: f32[{E}, {F}, {H}] from ["experts.{{e}}.w3.weight"]
  param w_down: f32[{E}, {H}, {F}] from ["experts.{{e}}.w2.weight"]
  graph entry {{
    %x = input "x" : f32[T, {H}]
    %router = param "router" : f32[{E}, {H}]
    %w_gate = param "w_gate" : f32[{E}, {F}, {H}]
    %w_up = param "w_up" : f32[{E}, {F}, {H}]
    %w_down = param "w_down" : f32[{E}, {H}, {F}]
    %logits = linear(%x, %router)
    %routes = moe_topk_softmax(%logits) {{top_k=2, renormalize=true}}
    %weights = getitem(%routes) {{index=0}}
    %ids = getitem(%routes) {{index=1}}
    %y = moe_experts(%x, %weights, %ids, %w_gate, %w_up, %w_down)
    return %y
  }}
}}
"""

FUSED = """
program p dtype=f32 {{
  config {{}}
  param router: f32[{E}, {H}] from ["gate.weight"]
  param wgate_up: f32[{E}, {F2}, {H}] from ["experts.{{e}}.w1.weight", "experts.{{e}}.w3.weight"] {{concat_dim=1}}
  param w_down: f32[{E}, {H}, {F}] from ["experts.{{e}}.w2.weight"]
  graph entry {{
    %x = input "x" : f32[T, {H}]
    %router = param "router" : f32[{E}, {H}]
    %wgate_up = param "wgate_up" : f32[{E}, {F2}, {H}]
    %w_down = param "w_down" : f32[{E}, {H}, {F}]
    %logits = linear(%x, %router)
    %routes = moe_topk_softmax(%logits) {{top_k=2, renormalize=true}}
    %weights = getitem(%routes) {{index=0}}
    %ids = getitem(%routes) {{index=1}}
    %y = moe_experts(%x, %weights, %ids, %wgate_up, %w_down)
    return %y
  }}
}}
"""


def typed(text: str):
    program = ShapeInference().run(parse_program(text.format(E=E, F=F_, F2=2 * F_, H=H)), PassContext())
    verify_program(program, require_types=True)
    return program


# ---------------------------------------------------------------- the routing dtype contract


def test_router_types_are_the_contract():
    out = typed(MOE).entry.node("routes").out
    assert [str(t) for t in out.items] == ["f32[T, 2]", "i32[T, 2]"]


@pytest.mark.parametrize("bad", ["i64", "f32", "bf16"])
def test_verifier_rejects_wrongly_typed_ids(bad):
    # a router whose ids value claims another dtype than the router contract's
    program = typed(MOE)
    g = program.entry.copy()
    ids = g.node("ids")
    g.replace("ids", ids.with_(out=type(ids.out)(ids.out.shape, bad)))
    with pytest.raises(VerifyError, match=rf"%ids = getitem is typed {bad}\[T, 2\] but its inputs give i32"):
        verify_program(program.with_graphs({"entry": g}), require_types=True)
    # ids from anywhere else (here a graph input) must be i32 to reach moe_experts
    t = type(ids.out)(ids.out.shape, bad)
    g = program.entry.copy()
    g.replace("ids", Node("input", (), Attrs({"name": "ids", "type": t}), t))
    with pytest.raises(VerifyError, match=rf"moe_experts ids must be i32 \(the router contract\), got {bad}"):
        verify_program(program.with_graphs({"entry": g}), require_types=True)
    text = MOE.replace("%ids = getitem(%routes) {{index=1}}", f'%ids = input "ids" : {bad}[T, 2]')
    with pytest.raises(ShapeInferenceError, match="moe_experts ids must be i32"):
        ShapeInference().run(parse_program(text.format(E=E, F=F_, F2=2 * F_, H=H)), PassContext())


def test_shape_rule_rejects_bad_weights_and_routes():
    t = typed(MOE).entry
    ins = [t.node(v).out for v in ("x", "weights", "ids", "w_gate", "w_up", "w_down")]
    OPS["moe_experts"].infer(ins, {})
    with pytest.raises(ShapeError, match="routing weights must be f32"):
        OPS["moe_experts"].infer([ins[0], type(ins[1])(ins[1].shape, "bf16"), *ins[2:]], {})
    with pytest.raises(ShapeError, match="fused expert gate_up"):
        OPS["moe_experts"].infer([*ins[:3], ins[3], ins[5]], {})  # [E, F, H] is not [E, 2F, H]
    with pytest.raises(ShapeError, match="top_k=5"):
        OPS["moe_topk_softmax"].infer([t.node("logits").out], {"top_k": 5})
    with pytest.raises(ShapeError, match="n_group=3"):
        OPS["moe_topk_grouped"].infer([t.node("logits").out], {"top_k": 2, "n_group": 3, "topk_group": 1})


# ---------------------------------------------------------------- fuse_expert_gate_up


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ckpt = {"gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        ckpt[f"experts.{e}.w1.weight"] = torch.randn(F_, H, generator=g)
        ckpt[f"experts.{e}.w3.weight"] = torch.randn(F_, H, generator=g)
        ckpt[f"experts.{e}.w2.weight"] = torch.randn(H, F_, generator=g)
    return ckpt


def _program_weights(program, tmp_path, ckpt) -> dict[str, torch.Tensor]:
    """The weights the converter writes for `program` from the checkpoint `ckpt`."""
    src = tmp_path / "ckpt"
    src.mkdir(parents=True, exist_ok=True)
    save_file(ckpt, str(src / "model.safetensors"))
    out = tmp_path / "art"
    (name,) = convert_weights(program, src, out, progress=False)
    with safe_open(str(out / "weights/rank0" / name), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_fuses_expert_gate_up(tmp_path):
    before = typed(MOE)
    ctx = PassContext()
    out = FuseExpertGateUp().run(before, ctx)
    verify_program(out, require_types=True)
    expected = typed(FUSED)
    assert dict(out.params) == dict(expected.params)
    assert_graphs_equal(out.entry, expected.entry)
    assert ctx.stats["matches"] == 1
    assert FuseExpertGateUp().run(out, PassContext()) is out  # nothing left to fuse


def test_fused_weights_convert_and_compute_the_same(tmp_path):
    ckpt = _checkpoint()
    before, after = typed(MOE), FuseExpertGateUp().run(typed(MOE), PassContext())
    w_before = _program_weights(before, tmp_path / "a", ckpt)
    w_after = _program_weights(after, tmp_path / "b", ckpt)
    assert w_before["w_gate"].shape == (E, F_, H)
    torch.testing.assert_close(w_before["w_gate"][2], ckpt["experts.2.w1.weight"])
    gu = w_after["wgate_up"]
    assert gu.shape == (E, 2 * F_, H)
    for e in range(E):  # per expert: its gate rows, then its up rows
        torch.testing.assert_close(gu[e, :F_], ckpt[f"experts.{e}.w1.weight"])
        torch.testing.assert_close(gu[e, F_:], ckpt[f"experts.{e}.w3.weight"])
    x = torch.randn(9, H)
    from kiln.compiler.interpret import run_graph
    from kiln.compiler.ops import RefContext

    ctx = RefContext(positions=torch.arange(9))
    (a,) = run_graph(before, before.entry, {"x": x}, w_before, ctx)
    (b,) = run_graph(after, after.entry, {"x": x}, w_after, ctx)
    torch.testing.assert_close(a, b)


def test_already_stacked_source_loads_as_is(tmp_path):
    """transformers' in-memory layout (`experts.gate_up_proj` [E, 2F, H]) is one source without `{e}`."""
    text = FUSED.replace('["experts.{{e}}.w1.weight", "experts.{{e}}.w3.weight"] {{concat_dim=1}}',
                         '["experts.gate_up_proj"]')
    program = typed(text)
    ckpt = _checkpoint()
    ckpt["experts.gate_up_proj"] = torch.randn(E, 2 * F_, H)
    w = _program_weights(program, tmp_path, ckpt)
    torch.testing.assert_close(w["wgate_up"], ckpt["experts.gate_up_proj"])


def test_missing_expert_tensor_is_a_located_error(tmp_path):
    from kiln.codegen.errors import WeightError

    ckpt = _checkpoint()
    del ckpt["experts.3.w2.weight"]
    with pytest.raises(WeightError, match=r"experts\.3\.w2\.weight"):
        _program_weights(typed(MOE), tmp_path, ckpt)


# ---------------------------------------------------------------- DSL


DSL = """
model m(hidden: int = 8, experts: int = 4, ffn: int = 6) {
  param w_gate: [experts, ffn, hidden] from "experts.{e}.w1.weight"
  param w_up: [experts, ffn, hidden] from "experts.{e}.w3.weight"
  param w_down: [experts, hidden, ffn] from "experts.{e}.w2.weight"
  param router: [experts, hidden] from "gate.weight"
  param embed: [16, hidden] from "embed"
  forward(tokens) {
    x = embedding(tokens, embed)
    weights, ids = moe_topk_softmax(linear(x, router), top_k=2, renormalize=true)
    return logits(moe_experts(x, weights, ids, w_gate, w_up, w_down), embed)
  }
}
"""


def _model(tmp_path, text):
    p = tmp_path / "m.dsl"
    p.write_text(text)
    (model,) = (d for d in load_file(p).models if d.name == "m")
    return model


def test_dsl_expert_stack_and_tuple_unpacking(tmp_path):
    program = instantiate_model(_model(tmp_path, DSL), {})
    assert program.params["w_gate"].source == ("experts.{e}.w1.weight",)
    assert program.params["w_gate"].expert_stacked and not program.params["router"].expert_stacked
    ops = program.entry.ops()
    assert ops.count("getitem") == 2 and "moe_topk_softmax" in ops
    verify_program(program, require_types=True)


def test_dsl_expert_index_needs_a_stack_dim(tmp_path):
    bad = DSL.replace('param router: [experts, hidden] from "gate.weight"',
                      'param router: [hidden] from "gate.{e}.weight"')
    with pytest.raises(SourceError, match=r"'\{e\}' \(the expert index\)"):
        _model(tmp_path, bad)


def test_dsl_unpacking_arity_is_checked(tmp_path):
    bad = DSL.replace("weights, ids = moe_topk_softmax", "weights, ids, more = moe_topk_softmax")
    bad = bad.replace("return logits(", "return logits(more + ")
    with pytest.raises(SourceError, match="3 targets but moe_topk_softmax returns 2 values"):
        instantiate_model(_model(tmp_path, bad), {})


# ---------------------------------------------------------------- from-hf and report


def _config(tmp_path, **cfg):
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


def test_from_hf_qwen3_moe_args(tmp_path):
    text = recipe_from_hf(_config(tmp_path))
    assert "model   = qwen3_moe(" in text
    for arg in ("moe_ffn=32", "experts=8", "top_k=2", "norm_topk_prob=true", "head_dim=16"):
        assert arg in text
    assert "ffn=128" not in text


@pytest.mark.parametrize("cfg", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}])
def test_from_hf_refuses_dense_layers_in_qwen3_moe(tmp_path, cfg):
    with pytest.raises(UnsupportedCheckpoint, match="dense MLP layers"):
        recipe_from_hf(_config(tmp_path, **cfg))


MIXTRAL_8X7B = """
recipe mixtral_8x7b {
  model    = mixtral(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, experts=8, top_k=2)
  weights  = random(seed=0)
  target   = h200
  dtype    = bf16
  kv_cache { block_size = 16; memory_fraction = 0.90 }
}
"""


def test_report_active_parameters_mixtral_8x7b(tmp_path, capsys):
    """Mixtral-8x7B by hand. Per layer: attention 2*4096^2 + 2*1024*4096 = 41,943,040; norms 8,192; router
    32,768; experts 8 * 3 * 14336 * 4096 = 1,409,286,144. Total 32 layers + embed/lm_head 2*32000*4096 + norm
    = 46,702,792,704 params = 93.41 GB bf16. Active: experts 2/8 -> 32 * (41,984,000 + 352,321,536) +
    262,148,096 = 12,879,925,248 params = 25.76 GB; experts 90.19 GB, active 22.55 GB."""
    from kiln.cli import main

    p = tmp_path / "mixtral.dsl"
    p.write_text(MIXTRAL_8X7B)
    assert main(["compile", str(p), "--report"]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704" in out
    assert "active per token       25.76 GB of 93.41 GB" in out
    assert "routed experts 22.55 GB of 90.19 GB" in out
