"""The KV pool's memory plan: the profile-run arithmetic (a pure function), the explicit sizes that win over
it, and the dummy prefill batch the CUDA profile runs (checked here on CPU against a dense forward)."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime import LLMEngine
from kiln.runtime.errors import ArtifactError
from kiln.runtime.worker.memory_plan import (
    DEFAULT_CPU_KV_BYTES,
    describe_memory_plan,
    plan_kv_cache,
    plan_memory,
    profile_batch,
    profile_lengths,
)
from standin_artifact import BLOCK_SIZE, dense_logits

GiB = 2**30


def test_plan_subtracts_weights_peak_and_graph_reserve():
    # 0.5 x 80 GiB = 40 GiB; - 10 weights - 3 peak - 1 graphs = 26 GiB; 2 MiB blocks -> 13312 of them
    plan = plan_kv_cache(bytes_per_block=2 * 2**20, total=80 * GiB, fraction=0.5, weights=10 * GiB,
                         activation_peak=3 * GiB, graph_reserve=1 * GiB)
    assert plan["kv_blocks"] == 13312 and plan["kv_bytes"] == 26 * GiB
    assert plan["weights"] + plan["activation_peak"] + plan["graph_reserve"] + plan["kv_bytes"] <= 40 * GiB


def test_plan_rounds_down_to_whole_blocks():
    plan = plan_kv_cache(bytes_per_block=1000, total=10_000, fraction=1.0, weights=1, activation_peak=0,
                         graph_reserve=0)
    assert plan["kv_blocks"] == 9 and plan["kv_bytes"] == 9000


def test_plan_is_capped_by_free_memory():
    # the budget would leave 26 GiB, but another process holds most of the device: 15 free - 3 - 1 = 11 GiB
    plan = plan_kv_cache(bytes_per_block=GiB, total=80 * GiB, fraction=0.5, weights=10 * GiB,
                         activation_peak=3 * GiB, graph_reserve=GiB, free=15 * GiB)
    assert plan["kv_blocks"] == 11


def test_plan_refuses_when_nothing_fits():
    with pytest.raises(ArtifactError) as e:
        plan_kv_cache(bytes_per_block=2**20, total=80 * GiB, fraction=0.5, weights=30 * GiB,
                      activation_peak=9 * GiB, graph_reserve=2 * GiB)
    msg = str(e.value)
    assert "no memory left for the KV cache" in msg
    assert "30.00 GiB weights" in msg and "9.00 GiB activation peak" in msg and "2.00 GiB CUDA-graph reserve" in msg
    assert "-1.00 GiB" in msg and "num_kv_blocks" in msg and "memory_fraction" in msg
    with pytest.raises(ArtifactError, match="only 2.50 GiB of the device is free"):
        plan_kv_cache(bytes_per_block=GiB, total=80 * GiB, fraction=0.5, weights=GiB, activation_peak=GiB,
                      graph_reserve=GiB, free=5 * GiB // 2)


def test_profile_lengths_follow_the_scheduler_chunks():
    assert profile_lengths(8192, 512, 4096, 256) == [512] * 16
    assert profile_lengths(1000, 300, 4096, 256) == [300, 300, 300, 100]
    assert profile_lengths(8192, None, 2048, 256) == [2048] * 4  # no chunking: whole prompts up to max_model_len
    assert profile_lengths(8192, 512, 4096, 3) == [512] * 3  # at most max_seqs sequences
    assert profile_lengths(100, 512, 4096, 256) == [100]


def test_profile_batch_runs_a_prefill_through_the_model(artifact_dir, standin_weights):
    """The dummy batch is a valid prefill of varied token ids: each sequence's last-token logits equal a dense
    forward of its ids."""
    engine = LLMEngine(artifact_dir, num_kv_blocks=4)
    kv = engine.artifact.kv_cache_config
    lengths = [9, 4, 1]
    vocab = engine.model_config.vocab_size
    fb = profile_batch(lengths, BLOCK_SIZE, torch.device("cpu"), vocab)
    ids = fb.input_ids.tolist()
    assert all(0 <= t < vocab for t in ids) and len(set(ids)) > len(ids) // 2  # spread, not one token
    blocks = sum(-(-n // BLOCK_SIZE) for n in lengths)
    assert fb.block_tables.shape[0] * fb.block_tables.shape[1] >= blocks
    caches = [torch.zeros((fb.block_tables.shape[0] * fb.block_tables.shape[1], *kv.shape), dtype=kv.dtype)
              for _ in range(kv.num_layers)]
    with torch.inference_mode():
        logits = engine.artifact.model.forward(fb, caches)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    expected = torch.stack([dense_logits(standin_weights, ids[s:s + n])[-1] for s, n in zip(starts, lengths)])
    torch.testing.assert_close(logits.float(), expected, rtol=1e-4, atol=1e-4)


def test_explicit_sizes_win_over_the_plan(artifact_dir, artifact_copy):
    cpu = torch.device("cpu")
    engine = LLMEngine(artifact_dir, num_kv_blocks=7)
    kv = engine.artifact.kv_cache_config
    plan = engine.runner.memory_plan
    assert plan == {"source": "num_kv_blocks", "kv_blocks": 7, "kv_bytes": 7 * kv.bytes_per_block}
    assert engine.block_manager.num_blocks == 7
    assert plan_memory(kv, cpu)["kv_blocks"] == DEFAULT_CPU_KV_BYTES // kv.bytes_per_block
    assert plan_memory(kv, cpu, kv_cache_bytes=10 * kv.bytes_per_block + 1)["kv_blocks"] == 10
    with pytest.raises(ArtifactError, match="no memory left for the KV cache"):
        plan_memory(kv, cpu, kv_cache_bytes=kv.bytes_per_block - 1)

    def with_blocks(m):
        m["kv_cache"]["num_blocks"] = 11
    art = artifact_copy(with_blocks)
    engine = LLMEngine(art)
    assert engine.runner.memory_plan["source"] == "manifest" and engine.block_manager.num_blocks == 11
    # an explicit count beats the manifest's; so does a byte budget
    assert LLMEngine(art, num_kv_blocks=5).block_manager.num_blocks == 5
    budget = LLMEngine(art, kv_cache_bytes=3 * kv.bytes_per_block)
    assert budget.block_manager.num_blocks == 3 and budget.runner.memory_plan["source"] == "kv_cache_bytes"


def test_describe_names_every_part():
    plan = plan_kv_cache(bytes_per_block=GiB, total=80 * GiB, fraction=0.5, weights=10 * GiB,
                         activation_peak=3 * GiB, graph_reserve=GiB)
    line = describe_memory_plan(plan, 16)
    assert line == ("KV cache: 26 blocks (416 tokens, 26.00 GiB) = 0.5 x 80.00 GiB - weights 10.00 GiB "
                    "- activation peak 3.00 GiB - CUDA-graph reserve 1.00 GiB")
    assert describe_memory_plan({"source": "manifest", "kv_blocks": 2, "kv_bytes": 10}, 16).endswith("from manifest")
