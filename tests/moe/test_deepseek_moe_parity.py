"""DeepSeek-V3/V2 with first-k dense layers then mixture-of-experts layers (models/deepseek_v3.dsl: blocks `dense`
and `moe`). The tiny checkpoints (examples/make_tiny_checkpoint.py) have 3 layers: layer 0 dense, layers 1-2 with
4 routed experts (top-2 from the best of 2 groups) + 1 shared expert. tests/mla/test_mla_parity_hf.py runs them
end to end against HF absorbed and un-absorbed; here: the layer index of the MoE block's checkpoint sources,
`kiln recipe from-hf`, the report's active parameters, and V2's plain greedy router end to end."""
from __future__ import annotations

import json

import pytest
import torch
from kiln.codegen.weights import weight_entries
from kiln.compiler import parse_program, print_program
from kiln.compiler.instantiate import instantiate_model
from kiln.compiler.report import expert_param_bytes
from kiln.dsl import load_recipe

import kiln
from kiln.cli import main
from kiln.recipe_from_hf import UnsupportedCheckpoint, recipe_from_hf

NEW_TOKENS = 32


def _recipe(tmp_path, ckpt) -> str:
    recipe = tmp_path / "recipe.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    return recipe


def test_moe_block_reads_checkpoint_layers_from_first_k_dense(tiny_checkpoint, tmp_path):
    loaded = load_recipe(str(_recipe(tmp_path, tiny_checkpoint("deepseek_v3"))))
    program = instantiate_model(loaded.model, dict(loaded.model_call.kwargs))
    assert [(b.name, b.count, b.first_layer) for b in program.blocks.values()] == [("dense", 1, 0), ("moe", 2, 1)]
    assert program.layer_schedule() == [("dense", 0), ("moe", 0), ("moe", 1)]
    sources = {e.name: e.spec.sources_for(e.layer) for e in weight_entries(program)}
    assert sources["dense.0.wq_a"] == ("model.layers.0.self_attn.q_a_proj.weight",)
    assert sources["moe.0.wq_a"] == ("model.layers.1.self_attn.q_a_proj.weight",)  # artifact name block-local
    assert sources["moe.1.w_router"] == ("model.layers.2.mlp.gate.weight",)
    assert sources["moe.1.router_bias"] == ("model.layers.2.mlp.gate.e_score_correction_bias",)
    assert sources["moe.0.w_down"] == ("model.layers.1.mlp.experts.{e}.down_proj.weight",)
    assert sources["moe.0.ws_gate"] == ("model.layers.1.mlp.shared_experts.gate_proj.weight",)
    # the IR text form carries first_layer
    text = print_program(program)
    assert "  block moe = moe x 2 {first_layer=1}\n" in text and "  block dense = dense x 1\n" in text
    assert parse_program(text).blocks == program.blocks

    (router,) = [n for _, n in program.graphs["moe"].items() if n.op == "moe_topk_grouped"]
    assert len(router.inputs) == 2  # logits + e_score_correction_bias
    assert {k: router.attrs[k] for k in ("top_k", "n_group", "topk_group", "routed_scaling", "renormalize",
                                          "scoring", "group_score")} == {
        "top_k": 2, "n_group": 2, "topk_group": 1, "routed_scaling": 2.5, "renormalize": True,
        "scoring": "sigmoid", "group_score": "top2_sum"}


V3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
      "num_attention_heads": 4, "intermediate_size": 128, "q_lora_rank": 24, "kv_lora_rank": 32,
      "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
      "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 2,
      "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _from_hf(tmp_path, **changes) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**V3, **changes}))
    return recipe_from_hf(tmp_path)


def test_from_hf_moe_args(tmp_path):
    v3 = _from_hf(tmp_path)
    for arg in ("first_k_dense=1", "experts=8", "top_k=2", "moe_ffn=32", "shared_experts=2", "n_group=4",
                "topk_group=2", "routed_scaling=2.5", "norm_topk_prob=true"):
        assert f"{arg}," in v3 or f"{arg})" in v3, arg
    assert "scoring" not in v3 and "correction_bias" not in v3  # V3: the model's defaults (sigmoid, bias)

    v2 = _from_hf(tmp_path, architectures=["DeepseekV2ForCausalLM"], topk_method="group_limited_greedy",
                  norm_topk_prob=False, routed_scaling_factor=16.0)
    for arg in ('scoring="softmax"', "correction_bias=false", "norm_topk_prob=false", 'group_score="max"',
                "n_group=4", "topk_group=2", "routed_scaling=16.0"):
        assert arg in v2, arg
    greedy = _from_hf(tmp_path, architectures=["DeepseekV2ForCausalLM"], topk_method="greedy", norm_topk_prob=False)
    assert "n_group" not in greedy and 'scoring="softmax"' in greedy

    dense = _from_hf(tmp_path, first_k_dense_replace=4)
    assert "first_k_dense=4" in dense and "experts=" not in dense


def test_from_hf_refuses_what_it_cannot_match(tmp_path):
    with pytest.raises(UnsupportedCheckpoint, match="topk_method 'noaux_tc'"):
        _from_hf(tmp_path, architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc", norm_topk_prob=False)
    with pytest.raises(UnsupportedCheckpoint, match="norm_topk_prob=true"):
        _from_hf(tmp_path, architectures=["DeepseekV2ForCausalLM"], topk_method="greedy", norm_topk_prob=True)
    with pytest.raises(UnsupportedCheckpoint, match="n_routed_experts"):
        _from_hf(tmp_path, n_routed_experts=None)


def test_report_active_parameters_tiny_v3(tiny_checkpoint, tmp_path):
    """By hand (fp32). Attention + norms per layer: 64 + 24*64 + 24 + 4*24*24 + 40*64 + 32 + 4*32*32 + 64*64 + 64
    = 14,776. Dense layer: + 3*128*64 = 39,352. MoE layer: + router 256 + bias 4 + experts 4*3*32*64 = 24,576
    + shared 3*32*64 = 6,144 -> 45,756. Total: 2*512*64 + 64 + 39,352 + 2*45,756 = 196,464 params. Routed
    experts 2 layers x 24,576 = 49,152 params (196,608 B), of which top-2 of 4 are read: 98,304 B."""
    result = kiln.compile(_recipe(tmp_path, tiny_checkpoint("deepseek_v3")), tmp_path / "art", progress=False)
    assert expert_param_bytes(result.program) == (196_608, 98_304)
    assert "parameters             196,464" in result.report
    assert "active per token" in result.report and "routed experts" in result.report


@torch.no_grad()
def test_v2_greedy_router_matches_hf(tiny_checkpoint, tiny_checkpoint_lib, tmp_path):
    """DeepSeek-V2 `topk_method="greedy"` (no groups): fp32 prompt logprobs within 1e-4 of HF, 32 greedy tokens
    identical, a batch equal to each prompt alone."""
    ckpt = tiny_checkpoint("deepseek_v2", topk_method="greedy")
    kiln.compile(_recipe(tmp_path, ckpt), tmp_path / "art", progress=False)
    hf = tiny_checkpoint_lib.load_hf_model(ckpt)
    llm = kiln.LLM(str(tmp_path / "art"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, hf.config.vocab_size, (n,), generator=g).tolist() for n in (6, 23)]
    params = kiln.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt])
        ref_lp = hf(ids).logits[0].float().log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        ref = list(prompt)
        for _ in range(NEW_TOKENS):
            ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
        ours = torch.tensor([out.prompt_logprobs[j][tok].logprob for j, tok in enumerate(prompt) if j > 0])
        torch.testing.assert_close(ours, ref_lp, atol=1e-4, rtol=0)
        assert out.outputs[0].token_ids == ref[len(prompt):]
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == out.outputs[0].token_ids
