"""fuse_gate_up: gate and up projections of one input become one linear over a fused param and two slices."""
import torch
from kiln.passes.fuse_gate_up import FuseGateUp
from pass_testlib import (
    assert_programs_equal,
    logits_before_after,
    run_pass,
    run_pass_on_text,
    tiny_llama_ir,
    typed,
)

BEFORE = """
program p dtype=f32 {
  config {}
  param w_gate: f32[12, 8] from ["gate.weight"]
  param w_up: f32[12, 8] from ["up.weight"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w_gate = param "w_gate" : f32[12, 8]
    %w_up = param "w_up" : f32[12, 8]
    %gate = linear(%x, %w_gate)
    %up = linear(%x, %w_up)
    %act = silu(%gate)
    %m = mul(%act, %up)
    return %m
  }
}
"""

EXPECTED = """
program p dtype=f32 {
  config {}
  param wgate_up: f32[24, 8] from ["gate.weight", "up.weight"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "wgate_up" : f32[24, 8]
    %y = linear(%x, %w)
    %gate = slice(%y) {start=0, stop=12}
    %up = slice(%y) {start=12, stop=24}
    %act = silu(%gate)
    %m = mul(%act, %up)
    return %m
  }
}
"""


def test_fuses_gate_and_up():
    out, ctx = run_pass(FuseGateUp(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["matches"] == 1


def test_either_operand_order_of_the_mul():
    out, ctx = run_pass(FuseGateUp(), typed(BEFORE.replace("mul(%act, %up)", "mul(%up, %act)")))
    assert_programs_equal(out, typed(EXPECTED.replace("mul(%act, %up)", "mul(%up, %act)")))
    assert ctx.stats["matches"] == 1


def test_block_params_fuse_as_wgate_up():
    out, _ = run_pass(FuseGateUp(), typed(tiny_llama_ir()))
    spec = out.params["decoder.wgate_up"]
    assert spec.shape == (96, 32) and spec.block == "decoder"
    assert spec.source == ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight")
    assert "decoder.w_gate" not in out.params and "decoder.w_up" not in out.params


def test_nothing_to_fuse_returns_the_same_program():
    cases = [
        # up projects a different input
        BEFORE.replace('%x = input "x" : f32[T, 8]', '%x = input "x" : f32[T, 8]\n    %x2 = input "x2" : f32[T, 8]')
              .replace("linear(%x, %w_up)", "linear(%x2, %w_up)"),
        # no silu: not a gated MLP
        BEFORE.replace("%act = silu(%gate)", "%act = add(%gate, %gate)"),
    ]
    for text in cases:
        before, out, ctx = run_pass_on_text(FuseGateUp(), text)
        assert out is before
        assert ctx.stats["matches"] == 0


def test_numerics_match_with_weights_built_from_the_checkpoint():
    before, after, ctx = run_pass_on_text(FuseGateUp(), tiny_llama_ir())
    assert ctx.stats["matches"] == 1
    ref, got = logits_before_after(before, after, seed=2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
