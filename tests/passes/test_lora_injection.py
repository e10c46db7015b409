"""lora_injection: every checkpoint-sourced linear of a block gets a `lora(x, y)` branch its readers read; fused
q/k/v and gate/up linears are adapted as one, their modules side by side."""
import pytest
import torch
from kiln.compiler import PassContext
from kiln.compiler.interpret import interpret
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_qkv import FuseQKV
from kiln.passes.fuse_silu_mul import FuseSiLUMul
from kiln.passes.lora_injection import LoRAInjection
from pass_testlib import (
    assert_programs_equal,
    random_checkpoint,
    run_pass,
    run_pass_on_text,
    tiny_llama_ir,
    tokens,
    typed,
    weights_from_checkpoint,
)

BLOCK = '{block="decoder"}'
BEFORE = f"""
program p dtype=f32 {{
  config {{}}
  param decoder.wqkv: f32[16, 8] from ["model.layers.{{i}}.self_attn.q_proj.weight", "model.layers.{{i}}.self_attn.k_proj.weight", "model.layers.{{i}}.self_attn.v_proj.weight"] {BLOCK}
  param decoder.wo: f32[8, 8] from ["model.layers.{{i}}.self_attn.o_proj.weight"] {BLOCK}
  param decoder.wgen: f32[8, 8] from [] {BLOCK}
  block decoder = decoder x 2
  graph entry {{
    %x = input "x" : f32[T, 8]
    %h = block(%x) {{block="decoder"}}
    return %h
  }}
  graph decoder {{
    %x = input "x" : f32[T, 8]
    %w = param "decoder.wqkv" : f32[16, 8]
    %y = linear(%x, %w)
    %q = slice(%y) {{start=0, stop=8}}
    %k = slice(%y) {{start=8, stop=12}}
    %v = slice(%y) {{start=12, stop=16}}
    %kv = concat(%k, %v)
    %a = add(%q, %kv)
    %wo = param "decoder.wo" : f32[8, 8]
    %o = linear(%a, %wo)
    %wgen = param "decoder.wgen" : f32[8, 8]
    %g = linear(%o, %wgen)
    return %g
  }}
}}
"""
QKV = ('modules=["model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.k_proj", '
       '"model.layers.{i}.self_attn.v_proj"], rows=[8, 4, 4]')
EXPECTED = BEFORE.replace("""    %y = linear(%x, %w)
    %q = slice(%y) {start=0, stop=8}
    %k = slice(%y) {start=8, stop=12}
    %v = slice(%y) {start=12, stop=16}""", f"""    %y0 = linear(%x, %w)
    %y = lora(%x, %y0) {{target="decoder.wqkv", {QKV}, max_rank=4}}
    %q = slice(%y) {{start=0, stop=8}}
    %k = slice(%y) {{start=8, stop=12}}
    %v = slice(%y) {{start=12, stop=16}}""").replace("""    %o = linear(%a, %wo)
""", """    %o0 = linear(%a, %wo)
    %o = lora(%a, %o0) {target="decoder.wo", modules=["model.layers.{i}.self_attn.o_proj"], rows=[8], max_rank=4}
""")


def test_adapts_fused_qkv_and_o_but_not_generated_weights():
    out, ctx = run_pass(LoRAInjection(max_rank=4), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["adapted"] == 2  # wgen has no checkpoint source: no PEFT module to adapt


def test_max_rank_comes_from_the_recipe():
    from kiln.compiler.options import LoraOptions, RecipeOptions
    options = RecipeOptions(lora=LoraOptions(max_rank=16), set_sections=frozenset({"lora"}))
    out = LoRAInjection().run(typed(BEFORE), PassContext(options=options.to_meta()))
    ranks = {n.attrs["max_rank"] for _, n in out.graphs["decoder"].items() if n.op == "lora"}
    assert ranks == {16}


def test_nothing_to_adapt_returns_the_same_program():
    cases = [
        BEFORE.replace('"model.layers.{i}.self_attn.o_proj.weight"', '"model.layers.{i}.self_attn.o_proj.scales"')
              .replace('["model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight", '
                       '"model.layers.{i}.self_attn.v_proj.weight"]', "[]"),
    ]
    for text in cases:
        before, out, ctx = run_pass_on_text(LoRAInjection(max_rank=4), text)
        assert out is before and ctx.stats["adapted"] == 0


def test_fused_slices_that_do_not_partition_the_output_are_left_alone():
    text = BEFORE.replace("%v = slice(%y) {start=12, stop=16}", "%v = slice(%y) {start=8, stop=12}")
    out, ctx = run_pass(LoRAInjection(max_rank=4), typed(text))
    assert [n.attrs["target"] for _, n in out.graphs["decoder"].items() if n.op == "lora"] == ["decoder.wo"]


def test_tiny_llama_after_fusion_adapts_every_projection_and_keeps_the_base_numerics():
    program = original = typed(tiny_llama_ir())
    for p in (FuseQKV(), FuseGateUp(), FuseSiLUMul()):
        program, _ = run_pass(p, program)
    out, ctx = run_pass(LoRAInjection(max_rank=8), program)
    loras = {n.attrs["target"]: tuple(n.attrs["rows"]) for _, n in out.graphs["decoder"].items() if n.op == "lora"}
    sizes = {s.name: s.shape[0] for s in original.params.values()}
    assert loras == {
        "decoder.wqkv": (sizes["decoder.wq"], sizes["decoder.wk"], sizes["decoder.wv"]),
        "decoder.wo": (sizes["decoder.wo"],),
        "decoder.wgate_up": (sizes["decoder.w_gate"], sizes["decoder.w_up"]),  # silu_mul reads [gate | up]
        "decoder.w_down": (sizes["decoder.w_down"],)}
    assert ctx.stats["adapted"] == 4
    ckpt = random_checkpoint(original, seed=0)
    ref, fused, got = (interpret(p, weights_from_checkpoint(p, ckpt), tokens()) for p in (original, program, out))
    torch.testing.assert_close(got, fused, atol=0, rtol=0)  # no adapter: the fused base model's logits, exactly
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)  # the unfused model's, up to fp32 summation order


@pytest.mark.parametrize("text", [BEFORE])
def test_every_lora_reads_the_projection_input(text):
    out, _ = run_pass(LoRAInjection(max_rank=4), typed(text))
    g = out.graphs["decoder"]
    for _, n in g.items():
        if n.op == "lora":
            assert g.node(n.inputs[1]).op == "linear" and g.node(n.inputs[1]).inputs[0] == n.inputs[0]
