"""Preemption on a real compiled artifact: a KV pool so small that sequences are preempted — by recompute
and by swapping their blocks to CPU memory — gives the same greedy tokens as a large pool."""
from __future__ import annotations

import json

import pytest
import torch

import kiln
from kiln.cli import main


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("preempt")
    recipe = work / "r.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(recipe)]) == 0
    text = recipe.read_text().replace("prefix_cache = radix }",
                                      "prefix_cache = none; preemption = swap; swap_space = 64MiB }")
    recipe.write_text(text)
    kiln.compile(recipe, work / "art", progress=False)
    return work / "art"


def test_manifest_carries_preemption_mode(artifact):
    sched = json.loads((artifact / "manifest.json").read_text())["scheduler"]
    assert sched["preemption"] == "swap" and sched["swap_space"] == 64 * 2**20


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_pool_same_greedy_tokens(artifact, mode):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (9, 23, 31, 17, 40, 12)]
    params = kiln.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in kiln.LLM(str(artifact)).generate(prompts, params)]
    llm = kiln.LLM(str(artifact), num_kv_blocks=8, preemption=mode)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_out"] > 0) == (mode == "swap")
    assert llm.engine.block_manager.num_free_blocks == 8
