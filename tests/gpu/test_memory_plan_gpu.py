"""The memory plan on a real GPU (h200 artifact, CUDA graphs, memory_fraction 0.5): the KV pool is what is left
of fraction x device memory after the weights, the measured activation peak of a max_batched_tokens prefill
and the decode graphs' reserve; after load and capture the process stays under fraction x device memory, and
so does a full max_batched_tokens prefill step."""
from __future__ import annotations

import gc

import pytest
import torch
from kiln.runtime import LLMEngine, SamplingParams

FRACTION = 0.5
SLACK = 64 * 2**20  # the sampler's and the step's host-visible tensors, allocator rounding


@pytest.fixture(scope="module")
def h200_art(h200_graph_artifact):
    def fraction(text: str) -> str:
        assert "memory_fraction = 0.9" in text
        return text.replace("memory_fraction = 0.9", f"memory_fraction = {FRACTION}")
    return h200_graph_artifact("gpu_memory_plan", fraction)


def _fresh_device():
    gc.collect()
    torch.cuda.empty_cache()


def test_plan_parts_add_up_and_load_stays_under_the_fraction(h200_art):
    _fresh_device()
    total = torch.cuda.mem_get_info()[1]
    engine = LLMEngine(h200_art, device="cuda")
    plan = engine.runner.memory_plan
    kv = engine.artifact.kv_cache_config
    assert plan["source"] == "profiled" and plan["fraction"] == FRACTION and plan["total"] == total
    assert plan["weights"] > 0 and plan["activation_peak"] > 0
    estimate = engine.artifact.manifest["cuda_graphs"]["estimated_bytes"]
    assert plan["graph_reserve"] == estimate > 0
    assert plan["kv_blocks"] == engine.block_manager.num_blocks > 0
    assert plan["kv_bytes"] == plan["kv_blocks"] * kv.bytes_per_block
    # the runner allocated exactly the planned pool (plus the graphs' one scratch block)
    allocated_kv = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    assert allocated_kv == plan["kv_bytes"] + kv.bytes_per_block
    parts = plan["kv_bytes"] + plan["weights"] + plan["activation_peak"] + plan["graph_reserve"]
    # the whole budget, less under one block of rounding (an idle device: free memory does not cap it)
    assert FRACTION * total - kv.bytes_per_block <= parts <= FRACTION * total
    assert engine.runner.graph_runner is not None and engine.runner.graph_runner.graphs
    after_load = torch.cuda.memory_allocated()
    assert after_load <= FRACTION * total, (after_load, plan, engine.runner.graph_runner.memory_bytes)
    print("memory plan:", plan, "graphs measured:", engine.runner.graph_runner.memory_bytes,
          "allocated after load:", after_load)

    # the largest step the scheduler builds: max_batched_tokens prompt tokens in one prefill step
    sched = engine.scheduler.config
    max_len = engine.model_config.max_model_len
    prompt = max_len - 1
    n = sched.max_batched_tokens // prompt
    assert n >= 2
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        engine.add_request(str(i), torch.randint(3, 200, (prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    torch.cuda.reset_peak_memory_stats()
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(out.finished for out in engine.step())
    assert finished == n
    peak = torch.cuda.max_memory_allocated()
    assert peak <= FRACTION * total + SLACK, (peak, plan)
    del engine
    _fresh_device()


def test_eager_load_reserves_no_graph_memory(h200_art):
    _fresh_device()
    total = torch.cuda.mem_get_info()[1]
    eager = LLMEngine(h200_art, device="cuda", enforce_eager=True)
    plan = eager.runner.memory_plan
    assert plan["source"] == "profiled" and plan["graph_reserve"] == 0 and eager.runner.graph_runner is None
    assert plan["activation_peak"] > 0
    parts = plan["kv_bytes"] + plan["weights"] + plan["activation_peak"]
    assert parts <= FRACTION * total and torch.cuda.memory_allocated() <= FRACTION * total
    del eager
    _fresh_device()
