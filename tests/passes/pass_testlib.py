"""Helpers for pass tests: typed IR from text, program comparison, checkpoint-derived weights, a tiny Llama."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from kiln.compiler import PassContext, Program, assert_graphs_equal, parse_program, verify_program
from kiln.compiler.interpret import interpret
from kiln.compiler.pass_manager import Pass
from kiln.passes.shape_inference import ShapeInference


def typed(text: str) -> Program:
    """A Program parsed from IR text, shape-inferred and verified."""
    program = ShapeInference().run(parse_program(text), PassContext())
    verify_program(program, require_types=True)
    return program


def run_pass(p: Pass, program: Program) -> tuple[Program, PassContext]:
    """Runs one pass the way the PassManager does (fresh stats), verifies its output, returns both."""
    ctx = PassContext()
    before = _snapshot(program)
    out = p.run(program, ctx)
    assert _snapshot(program) == before, f"{p.name} mutated its input"
    verify_program(out, require_types=True)
    return out, ctx


def run_pass_on_text(p: Pass, text: str) -> tuple[Program, Program, PassContext]:
    """`typed(text)` and `run_pass(p, ...)` on it: returns (input program, output program, context)."""
    before = typed(text)
    out, ctx = run_pass(p, before)
    return before, out, ctx


def _snapshot(program: Program) -> tuple:
    return (dict(program.params), {name: (tuple(g.items()), g.inputs, g.outputs) for name, g in program.graphs.items()})


def assert_programs_equal(actual: Program, expected: Program) -> None:
    """Same params (specs, any order) and structurally equal graphs of the same names."""
    assert dict(actual.params) == dict(expected.params), (
        f"params differ:\n  actual   {sorted(actual.params)}\n  expected {sorted(expected.params)}\n"
        + "\n".join(f"  {k}: {actual.params.get(k)} != {expected.params.get(k)}"
                    for k in sorted(set(actual.params) | set(expected.params))
                    if actual.params.get(k) != expected.params.get(k)))
    assert set(actual.graphs) == set(expected.graphs), f"graphs differ: {sorted(actual.graphs)} vs {sorted(expected.graphs)}"
    for name in expected.graphs:
        assert_graphs_equal(actual.graphs[name], expected.graphs[name])


# ---------------------------------------------------------------- weights, derived from a checkpoint


def _layers(program: Program, spec) -> list[tuple[int | None, int | None]]:
    """(block-local layer, global layer) per layer of `spec`: artifact names use the first, sources the second."""
    if spec.block is None:
        return [(None, None)]
    block = program.blocks[spec.block]
    return [(i, block.global_layer(i)) for i in range(block.count)]


def random_checkpoint(program: Program, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random "checkpoint" for an unfused program: one tensor per source name, shaped like its param.

    Norm weights centre on 1 and everything is scaled so activations stay O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    ckpt: dict[str, torch.Tensor] = {}
    for spec in program.params.values():
        assert len(spec.source) == 1, f"{spec.name}: a checkpoint param has exactly one source"
        for _, layer in _layers(program, spec):
            (name,) = spec.sources_for(layer)
            t = torch.randn(spec.shape, generator=gen)
            ckpt[name] = 1.0 + 0.1 * t if len(spec.shape) == 1 and "norm" in spec.name else t * spec.shape[-1] ** -0.5
    return ckpt


def weights_from_checkpoint(program: Program, ckpt: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The interpreter's weights (keyed by `ParamSpec.layer_name(i)`), each param built from its `source`
    tensors concatenated along `concat_dim`: the rule the weight converter follows for fused params."""
    weights = {}
    for spec in program.params.values():
        for i, layer in _layers(program, spec):
            parts = [ckpt[s] for s in spec.sources_for(layer)]
            w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.concat_dim)
            assert tuple(w.shape) == tuple(spec.shape), f"{spec.layer_name(i)}: built {tuple(w.shape)}, spec {spec.shape}"
            weights[spec.layer_name(i)] = w
    return weights


# ---------------------------------------------------------------- a two-layer Llama-like program as IR text

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 32, 4, 2, 8, 48, 2


def tiny_llama_ir(bias: bool = False) -> str:
    """GQA (4 query heads, 2 KV heads), rope, SwiGLU MLP; q/k/v biases when `bias` (Qwen2-like)."""
    nq, nkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layer = "model.layers.{i}"
    blk = ' {block="decoder"}'
    bias_params = "".join(
        f'  param decoder.b{r}: f32[{n}] from ["{layer}.self_attn.{r}_proj.bias"]{blk}\n'
        for r, n in (("q", nq), ("k", nkv), ("v", nkv))) if bias else ""
    bias_nodes = "".join(f'    %b{r} = param "decoder.b{r}" : f32[{n}]\n'
                         for r, n in (("q", nq), ("k", nkv), ("v", nkv))) if bias else ""
    b = {r: f", %b{r}" if bias else "" for r in "qkv"}
    return f"""
program tiny_llama dtype=f32 {{
  config {{"hidden": {HIDDEN}, "layers": {LAYERS}}}
  param embed: f32[{VOCAB}, {HIDDEN}] from ["model.embed_tokens.weight"]
  param decoder.attn_norm: f32[{HIDDEN}] from ["{layer}.input_layernorm.weight"]{blk}
  param decoder.wq: f32[{nq}, {HIDDEN}] from ["{layer}.self_attn.q_proj.weight"]{blk}
  param decoder.wk: f32[{nkv}, {HIDDEN}] from ["{layer}.self_attn.k_proj.weight"]{blk}
  param decoder.wv: f32[{nkv}, {HIDDEN}] from ["{layer}.self_attn.v_proj.weight"]{blk}
{bias_params}  param decoder.wo: f32[{HIDDEN}, {nq}] from ["{layer}.self_attn.o_proj.weight"]{blk}
  param decoder.mlp_norm: f32[{HIDDEN}] from ["{layer}.post_attention_layernorm.weight"]{blk}
  param decoder.w_gate: f32[{FFN}, {HIDDEN}] from ["{layer}.mlp.gate_proj.weight"]{blk}
  param decoder.w_up: f32[{FFN}, {HIDDEN}] from ["{layer}.mlp.up_proj.weight"]{blk}
  param decoder.w_down: f32[{HIDDEN}, {FFN}] from ["{layer}.mlp.down_proj.weight"]{blk}
  param norm: f32[{HIDDEN}] from ["model.norm.weight"]
  param lm_head: f32[{VOCAB}, {HIDDEN}] from ["lm_head.weight"]
  block decoder = decoder x {LAYERS}
  graph entry {{
    %tokens = input "tokens" : i32[T]
    %embed = param "embed" : f32[{VOCAB}, {HIDDEN}]
    %h0 = embedding(%tokens, %embed)
    %h = block(%h0) {{block="decoder"}}
    %norm = param "norm" : f32[{HIDDEN}]
    %x = rms_norm(%h, %norm) {{eps=1e-05}}
    %lm_head = param "lm_head" : f32[{VOCAB}, {HIDDEN}]
    %logits = logits(%x, %lm_head)
    return %logits
  }}
  graph decoder {{
    %h = input "h" : f32[T, {HIDDEN}]
    %attn_norm = param "decoder.attn_norm" : f32[{HIDDEN}]
    %x = rms_norm(%h, %attn_norm) {{eps=1e-05}}
    %wq = param "decoder.wq" : f32[{nq}, {HIDDEN}]
    %wk = param "decoder.wk" : f32[{nkv}, {HIDDEN}]
    %wv = param "decoder.wv" : f32[{nkv}, {HIDDEN}]
{bias_nodes}    %q0 = linear(%x, %wq{b["q"]})
    %k0 = linear(%x, %wk{b["k"]})
    %v0 = linear(%x, %wv{b["v"]})
    %q1 = view(%q0) {{shape=[{HEADS}, {HEAD_DIM}]}}
    %k1 = view(%k0) {{shape=[{KV_HEADS}, {HEAD_DIM}]}}
    %v = view(%v0) {{shape=[{KV_HEADS}, {HEAD_DIM}]}}
    %q = rope(%q1) {{theta=10000.0}}
    %k = rope(%k1) {{theta=10000.0}}
    %a = attention(%q, %k, %v)
    %wo = param "decoder.wo" : f32[{HIDDEN}, {nq}]
    %o = linear(%a, %wo)
    %h1 = add(%h, %o)
    %mlp_norm = param "decoder.mlp_norm" : f32[{HIDDEN}]
    %x1 = rms_norm(%h1, %mlp_norm) {{eps=1e-05}}
    %w_gate = param "decoder.w_gate" : f32[{FFN}, {HIDDEN}]
    %w_up = param "decoder.w_up" : f32[{FFN}, {HIDDEN}]
    %gate = linear(%x1, %w_gate)
    %up = linear(%x1, %w_up)
    %act = silu(%gate)
    %m = mul(%act, %up)
    %w_down = param "decoder.w_down" : f32[{HIDDEN}, {FFN}]
    %down = linear(%m, %w_down)
    %h2 = add(%h1, %down)
    return %h2
  }}
}}
"""


def tokens(n: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def logits_before_after(before: Program, after: Program, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Interpreter logits of `before` and `after` on `tokens()`, each with weights built from one random
    checkpoint (`random_checkpoint(before, seed)`) by the converter rule: (reference, got)."""
    ckpt = random_checkpoint(before, seed=seed)
    ref = interpret(before, weights_from_checkpoint(before, ckpt), tokens())
    got = interpret(after, weights_from_checkpoint(after, ckpt), tokens())
    return ref, got
