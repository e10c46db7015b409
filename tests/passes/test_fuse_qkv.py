"""fuse_qkv: q/k/v projections of one input become one linear over a fused param and three slices."""
import torch
from kiln.passes.fuse_qkv import FuseQKV
from pass_testlib import (
    assert_programs_equal,
    logits_before_after,
    run_pass,
    run_pass_on_text,
    tiny_llama_ir,
    typed,
)

PARAMS = """
  param wq: f32[8, 8] from ["q.weight"]
  param wk: f32[4, 8] from ["k.weight"]
  param wv: f32[4, 8] from ["v.weight"]
"""

ATTENTION_TAIL = """
    %q = view(%q0) {shape=[2, 4]}
    %k1 = view(%k0) {shape=[1, 4]}
    %k = rope(%k1)
    %v = view(%v0) {shape=[1, 4]}
    %a = attention(%q, %k, %v)
    return %a
  }
}
"""

BEFORE = """
program p dtype=f32 {
  config {}
""" + PARAMS + """
  graph entry {
    %x = input "x" : f32[T, 8]
    %wq = param "wq" : f32[8, 8]
    %wk = param "wk" : f32[4, 8]
    %wv = param "wv" : f32[4, 8]
    %q0 = linear(%x, %wq)
    %k0 = linear(%x, %wk)
    %v0 = linear(%x, %wv)
""" + ATTENTION_TAIL

EXPECTED = """
program p dtype=f32 {
  config {}
  param wqkv: f32[16, 8] from ["q.weight", "k.weight", "v.weight"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "wqkv" : f32[16, 8]
    %qkv = linear(%x, %w)
    %q0 = slice(%qkv) {start=0, stop=8}
    %k0 = slice(%qkv) {start=8, stop=12}
    %v0 = slice(%qkv) {start=12, stop=16}
""" + ATTENTION_TAIL


def test_fuses_q_k_v_into_one_linear():
    out, ctx = run_pass(FuseQKV(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["matches"] == 1


def test_fused_source_order_follows_attention_operands_not_graph_order():
    # v is projected first in the graph; the fused weight is still q, k, v (attention's operand order)
    before = BEFORE.replace("    %v0 = linear(%x, %wv)\n", "").replace(
        "    %q0 = linear(%x, %wq)\n", "    %v0 = linear(%x, %wv)\n    %q0 = linear(%x, %wq)\n")
    out, _ = run_pass(FuseQKV(), typed(before))
    assert_programs_equal(out, typed(EXPECTED))
    assert out.params["wqkv"].source == ("q.weight", "k.weight", "v.weight")


def test_biases_fuse_too():
    bias = PARAMS + """
  param bq: f32[8] from ["q.bias"]
  param bk: f32[4] from ["k.bias"]
  param bv: f32[4] from ["v.bias"]
"""
    before = BEFORE.replace(PARAMS, bias).replace("    %q0 = linear(%x, %wq)\n", """    %bq = param "bq" : f32[8]
    %bk = param "bk" : f32[4]
    %bv = param "bv" : f32[4]
    %q0 = linear(%x, %wq, %bq)
""").replace("linear(%x, %wk)", "linear(%x, %wk, %bk)").replace("linear(%x, %wv)", "linear(%x, %wv, %bv)")
    expected = EXPECTED.replace(
        'param wqkv: f32[16, 8] from ["q.weight", "k.weight", "v.weight"]',
        'param wqkv: f32[16, 8] from ["q.weight", "k.weight", "v.weight"]\n'
        '  param bqkv: f32[16] from ["q.bias", "k.bias", "v.bias"]').replace(
        "%qkv = linear(%x, %w)", '%b = param "bqkv" : f32[16]\n    %qkv = linear(%x, %w, %b)')
    out, ctx = run_pass(FuseQKV(), typed(before))
    assert_programs_equal(out, typed(expected))
    assert ctx.stats["by_rewrite"] == {"qkv_bias": 1}


def test_block_params_fuse_under_the_block_name_with_layer_templates():
    out, ctx = run_pass(FuseQKV(), typed(tiny_llama_ir()))
    spec = out.params["decoder.wqkv"]
    assert spec.block == "decoder" and spec.shape == (64, 32) and spec.concat_dim == 0
    assert spec.source == tuple(f"model.layers.{{i}}.self_attn.{r}_proj.weight" for r in "qkv")
    assert not {"decoder.wq", "decoder.wk", "decoder.wv"} & set(out.params)
    assert out.graphs["decoder"].count("linear") == 5 and ctx.stats["matches"] == 1


def test_a_param_read_elsewhere_is_kept():
    before = BEFORE.replace("return %a", "%again = linear(%x, %wq)\n    return %a, %again")
    out, _ = run_pass(FuseQKV(), typed(before))
    assert set(out.params) == {"wqkv", "wq"}


def test_nothing_to_fuse_returns_the_same_program():
    cases = [
        # k projects a different input
        BEFORE.replace('%x = input "x" : f32[T, 8]', '%x = input "x" : f32[T, 8]\n    %x2 = input "x2" : f32[T, 8]')
              .replace("linear(%x, %wk)", "linear(%x2, %wk)"),
        # only q has a bias
        BEFORE.replace(PARAMS, PARAMS + '  param bq: f32[8] from ["q.bias"]\n')
              .replace("%q0 = linear(%x, %wq)", '%bq = param "bq" : f32[8]\n    %q0 = linear(%x, %wq, %bq)'),
        # v's weight is quantized: a plain concatenation would lose its scales
        BEFORE.replace('from ["v.weight"]', 'from ["v.weight"] {quant={"scheme": "fp8"}}'),
    ]
    for text in cases:
        before, out, ctx = run_pass_on_text(FuseQKV(), text)
        assert out is before
        assert_programs_equal(out, typed(text))
        assert ctx.stats["matches"] == 0


def test_numerics_match_with_weights_built_from_the_checkpoint():
    for bias in (False, True):
        before, after, _ = run_pass_on_text(FuseQKV(), tiny_llama_ir(bias))
        ref, got = logits_before_after(before, after, seed=1)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
