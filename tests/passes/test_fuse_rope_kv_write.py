"""fuse_rope_kv_write: the rope of q and k moves into the attention that caches k (attention {rope=...})."""
import re

import pytest
import torch
from kiln.compiler import PassContext, PassManager, parse_program, print_program
from kiln.compiler.interpret import interpret
from kiln.passes.fuse_rope_kv_write import FuseRopeKVWrite
from kiln.passes.shape_inference import ShapeInferenceError
from pass_testlib import (
    assert_programs_equal,
    logits_before_after,
    random_checkpoint,
    run_pass,
    run_pass_on_text,
    tiny_llama_ir,
    tokens,
    typed,
    weights_from_checkpoint,
)

# Llama-3.1 scaling plus an attribute the rope op does not declare (an annotation): the pass must carry the
# rope's attribute dict whole, not a list of keys it knows.
ROPE = 'theta=500000.0, scaling="llama3", factor=8.0, original_max_position=64, note="kept"'
ROPE_JSON = '{"factor": 8.0, "note": "kept", "original_max_position": 64, "scaling": "llama3", "theta": 500000.0}'

BEFORE = f"""
program p dtype=f32 {{
  config {{}}
  graph entry {{
    %q0 = input "q" : f32[T, 32]
    %k0 = input "k" : f32[T, 16]
    %v0 = input "v" : f32[T, 16]
    %q1 = view(%q0) {{shape=[4, 8]}}
    %k1 = view(%k0) {{shape=[2, 8]}}
    %v = view(%v0) {{shape=[2, 8]}}
    %q = rope(%q1) {{{ROPE}}}
    %k = rope(%k1) {{{ROPE}}}
    %a = attention(%q, %k, %v) {{sliding_window=4}}
    return %a
  }}
}}
"""

EXPECTED = f"""
program p dtype=f32 {{
  config {{}}
  graph entry {{
    %q0 = input "q" : f32[T, 32]
    %k0 = input "k" : f32[T, 16]
    %v0 = input "v" : f32[T, 16]
    %q1 = view(%q0) {{shape=[4, 8]}}
    %k1 = view(%k0) {{shape=[2, 8]}}
    %v = view(%v0) {{shape=[2, 8]}}
    %a = attention(%q1, %k1, %v) {{sliding_window=4, rope={ROPE_JSON}}}
    return %a
  }}
}}
"""


def test_rope_of_q_and_k_moves_into_the_attention_with_every_attribute():
    out, ctx = run_pass(FuseRopeKVWrite(), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["matches"] == 1
    assert dict(out.entry.node("a").attrs["rope"])["note"] == "kept"


def test_qk_norm_before_rope_still_fuses():
    """Qwen3: per-head rms_norm of q and k, then rope: the attention reads the normed, un-roped heads."""
    norm = ('    %qn = param "qn" : f32[8]\n    %kn = param "kn" : f32[8]\n'
            '    %q2 = rms_norm(%q1, %qn) {eps=1e-06}\n    %k2 = rms_norm(%k1, %kn) {eps=1e-06}\n')
    params = '  param qn: f32[8] from ["q_norm.weight"]\n  param kn: f32[8] from ["k_norm.weight"]\n'

    def qwen3(text: str) -> str:
        text = text.replace("  graph entry", params + "  graph entry").replace("    %v = view", norm + "    %v = view")
        return text.replace("rope(%q1)", "rope(%q2)").replace("rope(%k1)", "rope(%k2)")

    out, ctx = run_pass(FuseRopeKVWrite(), typed(qwen3(BEFORE)))
    expected = qwen3(EXPECTED).replace("attention(%q1, %k1, %v)", "attention(%q2, %k2, %v)")
    assert_programs_equal(out, typed(expected))
    assert ctx.stats["matches"] == 1


def test_a_rope_read_elsewhere_stays_for_that_reader():
    before = BEFORE.replace("return %a", "return %a, %k")
    out, ctx = run_pass(FuseRopeKVWrite(), typed(before))
    expected = EXPECTED.replace(
        "    %a = attention", f"    %k = rope(%k1) {{{ROPE}}}\n    %a = attention").replace("return %a", "return %a, %k")
    assert_programs_equal(out, typed(expected))
    assert ctx.stats["matches"] == 1


@pytest.mark.parametrize("change", ["k_rope_differs", "q_not_roped"])
def test_nothing_changes_when_the_pattern_differs(change):
    if change == "k_rope_differs":  # q and k rotated differently: one table cannot serve both
        text = BEFORE.replace(f"%k = rope(%k1) {{{ROPE}}}", "%k = rope(%k1) {theta=10000.0}")
    else:
        text = BEFORE.replace(f"%q = rope(%q1) {{{ROPE}}}", "%q = view(%q0) {shape=[4, 8]}")
    before, out, ctx = run_pass_on_text(FuseRopeKVWrite(), text)
    assert out is before
    assert ctx.stats["matches"] == 0


FP8 = """
program p dtype=f32 {
  config {}
  param ks: f32[2] from ["k_scale"]
  param vs: f32[2] from ["v_scale"]
  graph entry {
    %q0 = input "q" : f32[T, 4, 8]
    %k0 = input "k" : f32[T, 2, 8]
    %v = input "v" : f32[T, 2, 8]
    %ks = param "ks" : f32[2]
    %vs = param "vs" : f32[2]
    %q = rope(%q0) {theta=10000.0}
    %k = rope(%k0) {theta=10000.0}
    %a = attention(%q, %k, %v, %ks, %vs) {kv_dtype="fp8e4m3"}
    return %a
  }
}
"""


def test_fp8_kv_attention_is_left_alone_and_cannot_carry_a_rope():
    """Calibrating fp8 KV scales observes the attention's k, which must be roped: no fusion, and the op
    refuses a rope next to kv_dtype."""
    before, out, ctx = run_pass_on_text(FuseRopeKVWrite(), FP8)
    assert out is before and ctx.stats["matches"] == 0
    bad = FP8.replace("attention(%q, %k, %v, %ks, %vs) {kv_dtype=\"fp8e4m3\"}",
                      "attention(%q0, %k0, %v, %ks, %vs) {kv_dtype=\"fp8e4m3\", rope={\"theta\": 10000.0}}")
    with pytest.raises(ShapeInferenceError, match="fused rope takes no fp8 KV cache"):
        typed(bad)


def test_numerics_with_llama3_scaled_rope():
    """Interpreter logits before and after on the two-layer Llama-like program, its rope Llama-3.1-scaled
    with positions past the original context (where the scaling matters)."""
    text = tiny_llama_ir().replace(
        "{theta=10000.0}", '{theta=500000.0, scaling="llama3", factor=8.0, original_max_position=4}')
    before, after, ctx = run_pass_on_text(FuseRopeKVWrite(), text)
    assert ctx.stats["matches"] == 1  # one decoder graph, two layers
    assert after.graphs["decoder"].count("rope") == 0
    ref, got = logits_before_after(before, after, seed=3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # and the attention's rope attribute is what rotates: dropped, the logits change
    unroped = parse_program(re.sub(r" \{rope=\{[^}]*\}\}", "", print_program(after)))
    assert "rope=" not in print_program(unroped)
    _, no_rope = logits_before_after(before, typed(print_program(unroped)), seed=3)
    assert (no_rope - ref).abs().max() > 1e-2


def test_full_pipeline_fuses_after_quantize_kv_cache():
    names = PassManager.for_target("cpu").names
    assert names.index("quantize_kv_cache") < names.index("fuse_rope_kv_write") < names.index("kernel_selection")
    ctx = PassContext(target="cpu")
    after = PassManager.for_target("cpu").run(typed(tiny_llama_ir()), ctx)
    (node,) = [n for _, n in after.graphs["decoder"].items() if n.op == "attention"]
    assert node.attrs["rope"] == {"theta": 10000.0} and node.attrs["kernel"] == "tvm.paged_attention"
    assert after.graphs["decoder"].count("rope") == 0


MLA = """
program p dtype=f32 {
  config {}
  param w_kv_b: f32[48, 16] from ["kv_b_proj.weight"]
  graph entry {
    %q_nope = input "q_nope" : f32[T, 2, 8]
    %q_pe0 = input "q_pe" : f32[T, 2, 4]
    %c_kv = input "c_kv" : f32[T, 16]
    %k_pe0 = input "k_pe" : f32[T, 1, 4]
    %w_kv_b = param "w_kv_b" : f32[48, 16]
    %q_pe = rope(%q_pe0) {theta=10000.0}
    %k_pe = rope(%k_pe0) {theta=10000.0}
    %a = mla_attention(%q_nope, %q_pe, %c_kv, %k_pe, %w_kv_b)
    return %a
  }
}
"""


def test_mla_attention_keeps_its_ropes():
    """MLA ropes only q_pe / k_pe, separate inputs of mla_attention (its latent cache is written by its own
    kernel): not the pattern, nothing changes."""
    before, out, ctx = run_pass_on_text(FuseRopeKVWrite(), MLA)
    assert out is before and ctx.stats["matches"] == 0


# Phi-4-mini's rope: LongRoPE factor lists and a partial rotary dim (6 of 8), attributes a list-valued one among them
LONGROPE = ('theta=10000.0, scaling="longrope", factor=4.0, original_max_position=4, rotary_dim=6, '
            'short_factor=[1.0, 1.5, 2.0], long_factor=[1.2, 3.0, 7.5]')
LONGROPE_JSON = ('{"factor": 4.0, "long_factor": [1.2, 3.0, 7.5], "original_max_position": 4, "rotary_dim": 6, '
                 '"scaling": "longrope", "short_factor": [1.0, 1.5, 2.0], "theta": 10000.0}')


def test_longrope_and_partial_rotary_move_into_the_attention():
    out, ctx = run_pass(FuseRopeKVWrite(), typed(BEFORE.replace(ROPE, LONGROPE)))
    assert_programs_equal(out, typed(EXPECTED.replace(ROPE_JSON, LONGROPE_JSON)))
    assert ctx.stats["matches"] == 1
    rope = out.entry.node("a").attrs["rope"]
    assert (rope["rotary_dim"], rope["long_factor"]) == (6, (1.2, 3.0, 7.5))
    assert_programs_equal(typed(print_program(out)), out)  # the list-valued attributes survive the text form


def test_numerics_with_longrope_partial_rotary():
    """The 11-token sequence runs past the original context of 4: the long factors rotate 6 of each head's 8
    dims. Fused or not, the interpreter's logits agree; the absorbed rope's rotary_dim and factors matter."""
    text = tiny_llama_ir().replace("{theta=10000.0}", "{" + LONGROPE + "}")
    before, after, ctx = run_pass_on_text(FuseRopeKVWrite(), text)
    assert ctx.stats["matches"] == 1 and after.graphs["decoder"].count("rope") == 0
    ckpt = random_checkpoint(before, seed=5)
    logits = lambda p: interpret(p, weights_from_checkpoint(p, ckpt), tokens())  # noqa: E731
    ref = logits(before)
    torch.testing.assert_close(logits(after), ref, atol=1e-5, rtol=0)
    fused = print_program(after)
    for old, new in (('"long_factor": [1.2, 3.0, 7.5]', '"long_factor": [1.0, 1.5, 2.0]'),  # = short_factor
                     ('"long_factor": [1.2, 3.0, 7.5], "original_max_position": 4, "rotary_dim": 6, '
                      '"scaling": "longrope", "short_factor": [1.0, 1.5, 2.0]',
                      '"long_factor": [1.2, 3.0, 7.5, 1.0], "original_max_position": 4, "rotary_dim": 8, '
                      '"scaling": "longrope", "short_factor": [1.0, 1.5, 2.0, 1.0]')):
        assert old in fused
        other = logits(typed(fused.replace(old, new)))
        assert (other - ref).abs().max() > 1e-3, f"{new} computes what {old} does"
