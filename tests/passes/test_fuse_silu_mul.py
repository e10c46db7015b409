"""fuse_silu_mul: silu(first half) * second half of one value becomes silu_mul."""
import torch
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_silu_mul import FuseSiLUMul
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
  graph entry {
    %y = input "y" : f32[T, 24]
    %gate = slice(%y) {start=0, stop=12}
    %up = slice(%y) {start=12, stop=24}
    %act = silu(%gate)
    %m = mul(%act, %up)
    return %m
  }
}
"""

EXPECTED = """
program p dtype=f32 {
  config {}
  graph entry {
    %y = input "y" : f32[T, 24]
    %m = silu_mul(%y)
    return %m
  }
}
"""


def test_fuses_silu_times_second_half():
    out, ctx = run_pass(FuseSiLUMul(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["matches"] == 1


def test_swapped_mul_operands_and_a_slice_read_elsewhere():
    before = BEFORE.replace("mul(%act, %up)", "mul(%up, %act)").replace("return %m", "return %m, %up")
    expected = EXPECTED.replace("return %m", "%up = slice(%y) {start=12, stop=24}\n    return %m, %up")
    out, ctx = run_pass(FuseSiLUMul(), typed(before))
    assert_programs_equal(out, typed(expected))
    assert ctx.stats["matches"] == 1


def test_guard_rejects_slices_that_are_not_the_two_halves():
    cases = [
        BEFORE.replace("%up = slice(%y) {start=12, stop=24}", "%up = slice(%y) {start=0, stop=12}"),
        BEFORE.replace("stop=12}", "stop=8}").replace("{start=12, stop=24}", "{start=8, stop=16}"),  # y is 24 wide
        BEFORE.replace('%y = input "y" : f32[T, 24]', '%y = input "y" : f32[T, 24]\n    %z = input "z" : f32[T, 24]')
              .replace("%up = slice(%y)", "%up = slice(%z)"),  # halves of different values
    ]
    for text in cases:
        before, out, ctx = run_pass_on_text(FuseSiLUMul(), text)
        assert out is before
        assert_programs_equal(out, typed(text))
        assert ctx.stats["matches"] == 0


def test_numerics_after_gate_up_fusion():
    before, gate_up, _ = run_pass_on_text(FuseGateUp(), tiny_llama_ir())
    after, ctx = run_pass(FuseSiLUMul(), gate_up)
    assert ctx.stats["matches"] == 1 and after.graphs["decoder"].count("silu_mul") == 1
    assert after.graphs["decoder"].count("silu") == 0 and after.graphs["decoder"].count("slice") == 0
    ref, got = logits_before_after(before, after, seed=3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
