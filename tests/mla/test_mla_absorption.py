"""mla_absorption: IR before/after as text, the cases it leaves alone, and numerics (absorbed == un-absorbed,
both == HF DeepseekV3ForCausalLM) through the reference interpreter on models/deepseek_v3.dsl."""
from __future__ import annotations

import pytest
import torch
from kiln.compiler import PassContext, assert_graphs_equal, parse_program, verify_program
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.interpret import interpret
from kiln.dsl import load_recipe
from kiln.passes.mla_absorption import MLAAbsorption
from kiln.passes.shape_inference import ShapeInference

BEFORE = """
program p dtype=f32 {
  config {}
  param wkv_b: f32[128, 32] from ["kv_b_proj.weight"]
  graph entry {
    %q_nope = input "q_nope" : f32[T, 4, 16]
    %q_pe = input "q_pe" : f32[T, 4, 8]
    %c_kv = input "c_kv" : f32[T, 32]
    %k_pe = input "k_pe" : f32[T, 1, 8]
    %wkv_b = param "wkv_b" : f32[128, 32]
    %a = mla_attention(%q_nope, %q_pe, %c_kv, %k_pe, %wkv_b) {scale=0.2}
    return %a
  }
}
"""

# decode queries become latent-space queries (q_nope·W_UK) over the cached [c_kv | k_pe]; W_UV moves to the output
EXPECTED = BEFORE.replace("{scale=0.2}", '{absorb="decode", scale=0.2}')


def _typed(text: str):
    program = ShapeInference().run(parse_program(text), PassContext())
    verify_program(program, require_types=True)
    return program


def _run(program):
    ctx = PassContext()
    out = MLAAbsorption().run(program, ctx)
    verify_program(out, require_types=True)
    return out, ctx


def test_decode_absorption_is_marked_on_the_op():
    before = _typed(BEFORE)
    out, ctx = _run(before)
    assert_graphs_equal(out.entry, _typed(EXPECTED).entry)
    assert dict(out.params) == dict(before.params)  # W_UK / W_UV are views of w_kv_b: no new weights
    assert ctx.stats["matches"] == 1 and ctx.stats["by_rewrite"] == {"mla_absorb_decode": 1}
    assert before.entry.node("a").attrs.get("absorb") is None  # the input program is untouched


@pytest.mark.parametrize("text", [
    EXPECTED,  # already absorbed
    BEFORE.replace('from ["kv_b_proj.weight"]', 'from ["kv_b_proj.weight"] {quant={"scheme": "fp8"}}'),
], ids=["already-absorbed", "quantized-w_kv_b"])
def test_nothing_to_absorb_returns_the_same_program(text):
    before = _typed(text)
    out, ctx = _run(before)
    assert out is before and ctx.stats["matches"] == 0


SHAPE = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 48, "max_position_embeddings": 128, "q_lora_rank": 24,
         "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
         "first_k_dense_replace": 2, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}
DSL = ("deepseek_v3(vocab=96, hidden=32, layers=2, heads=4, ffn=48, q_lora_rank=24, kv_lora_rank=32, "
       "qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)")


@torch.no_grad()
def test_absorbed_equals_unabsorbed_equals_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**SHAPE, attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    for name, p in hf.named_parameters():
        p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    state = hf.state_dict()

    path = tmp_path / "r.dsl"
    path.write_text(f"recipe r {{ model = {DSL} }}\n")
    loaded = load_recipe(str(path))
    before = ShapeInference().run(instantiate_model(loaded.model, dict(loaded.model_call.kwargs)), PassContext())
    after, ctx = _run(before)
    assert ctx.stats["matches"] == 1  # one block graph, shared by both layers
    assert [n.attrs.get("absorb") for _, n in after.graphs["dense"].items() if n.op == "mla_attention"] == ["decode"]

    weights = {}
    for spec in before.params.values():
        for i in range(before.blocks[spec.block].count) if spec.block else [None]:
            layer = before.blocks[spec.block].global_layer(i) if spec.block else None
            weights[spec.layer_name(i)] = state[spec.source[0].format(i=layer)]
    tokens = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(1))
    unabsorbed = interpret(before, weights, tokens)
    absorbed = interpret(after, weights, tokens)
    torch.testing.assert_close(absorbed, unabsorbed, atol=1e-4, rtol=0)
    torch.testing.assert_close(unabsorbed, hf(tokens[None]).logits[0], atol=1e-4, rtol=0)
