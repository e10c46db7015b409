"""fuse_add_rms_norm: a residual add and the rms_norm reading it become one add_rms_norm."""
import torch
from kiln.passes.fuse_add_rms_norm import FuseAddRMSNorm
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
  param w: f32[8] from ["norm.weight"]
  graph entry {
    %h = input "h" : f32[T, 8]
    %o = input "o" : f32[T, 8]
    %w = param "w" : f32[8]
    %s = add(%h, %o)
    %x = rms_norm(%s, %w) {eps=1e-05}
    %r = mul(%x, %s)
    return %r
  }
}
"""

EXPECTED = """
program p dtype=f32 {
  config {}
  param w: f32[8] from ["norm.weight"]
  graph entry {
    %h = input "h" : f32[T, 8]
    %o = input "o" : f32[T, 8]
    %w = param "w" : f32[8]
    %t = add_rms_norm(%h, %o, %w) {eps=1e-05}
    %x = getitem(%t) {index=0}
    %s = getitem(%t) {index=1}
    %r = mul(%x, %s)
    return %r
  }
}
"""


def test_fuses_add_and_norm_when_the_sum_is_read_elsewhere():
    out, ctx = run_pass(FuseAddRMSNorm(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["matches"] == 1


def test_a_sum_that_is_a_graph_output_counts_as_read_elsewhere():
    before = BEFORE.replace("%r = mul(%x, %s)\n    return %r", "return %x, %s")
    expected = EXPECTED.replace("%r = mul(%x, %s)\n    return %r", "return %x, %s")
    out, _ = run_pass(FuseAddRMSNorm(), typed(before))
    assert_programs_equal(out, typed(expected))


def test_nothing_changes_when_the_norm_is_the_sums_only_reader():
    text = BEFORE.replace("%r = mul(%x, %s)", "%r = mul(%x, %x)")
    before, out, ctx = run_pass_on_text(FuseAddRMSNorm(), text)
    assert out is before
    assert_programs_equal(out, typed(text))
    assert ctx.stats["matches"] == 0


def test_numerics_on_the_decoder_residual_stream():
    before, after, ctx = run_pass_on_text(FuseAddRMSNorm(), tiny_llama_ir())
    assert ctx.stats["matches"] == 1  # h1 feeds mlp_norm and the second residual add; the others read no add
    ref, got = logits_before_after(before, after, seed=4)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
