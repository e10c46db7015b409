"""all_to_all MoE dispatch (passes/place_parallel.py -> moe_experts_a2a): under data-parallel attention with one
rank per expert group, a MoE's rows stay on their ranks and its (token, expert) pairs travel to the experts'
ranks and back. The IR has no gather/scatter of rows around such a MoE (DeepSeek's shared experts, which gather
the rows anyway, keep the gather path unless `dense = replicated` holds them whole on every rank); over gloo worker processes (all_to_all_single) a tiny Qwen3-MoE gives
the single-device artifact's greedy tokens and prompt logprobs (1e-4). Its HF parity on the single-process mesh
is test_parallel_parity.py's qwen3_moe dp = 2 case."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel_gloo import _run, assert_same_outputs  # noqa: E402


def test_experts_on_their_own_ranks_are_reached_by_all_to_all(compile_parallel):
    _, art = compile_parallel("qwen3_moe", "dp = 2; ep = 2")
    model = (art / "model.py").read_text()  # the generated calls, one per IR node
    assert "K.moe_experts_a2a(" in model and "K.moe_experts(" not in model
    assert "K.dp_gather(" in model  # the logits rows at the end ...
    assert "K.dp_scatter(" not in model and model.count("K.dp_gather(") == 1  # ... and nothing around attention/MoE
    _, deepseek = compile_parallel("deepseek_v3", "dp = 2; ep = 2")
    model = (deepseek / "model.py").read_text()
    assert "K.moe_experts(" in model and "K.dp_scatter(" in model  # its shared experts gather the rows anyway
    _, deepseek = compile_parallel("deepseek_v3", "dp = 2; ep = 2; dense = replicated")
    model = (deepseek / "model.py").read_text()  # shared experts and the dense layer 0 on each rank's own rows
    assert "K.moe_experts_a2a(" in model and "K.moe_experts(" not in model
    assert "K.dp_scatter(" not in model and model.count("K.dp_gather(") == 1


def test_gloo_all_to_all_dispatch_matches_single_device(compile_parallel):
    _, single = compile_parallel("qwen3_moe", None)
    _, art = compile_parallel("qwen3_moe", "dp = 2; ep = 2")
    assert_same_outputs(_run(art), _run(single))


def test_gloo_all_to_all_with_replicated_shared_experts_matches_single_device(compile_parallel):
    _, single = compile_parallel("deepseek_v3", None)
    _, art = compile_parallel("deepseek_v3", "dp = 2; ep = 2; dense = replicated")
    assert_same_outputs(_run(art), _run(single))
