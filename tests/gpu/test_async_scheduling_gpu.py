"""Async scheduling on a real GPU (h200 artifact, CUDA graphs): the same greedy tokens as the synchronous engine,
and a steady decode step that never makes the host wait for the device except for the one event marking the
previous step's tokens (torch's sync debug mode flags every other synchronizing call)."""
from __future__ import annotations

import warnings

import pytest
import torch
from kiln.runtime import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def h200_art(h200_graph_artifact):
    return h200_graph_artifact("gpu_async")


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (k,), generator=g).tolist() for k in (3, 9, 17, 5, 30, 2, 7, 11)[:n]]


def test_async_greedy_equals_synchronous(h200_art):
    # every request ends by length at the same step, so both modes run the same batches through the same graphs
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in (False, True):
        engine = LLMEngine(h200_art, device="cuda", num_kv_blocks=128, max_num_seqs=16, async_scheduling=mode)
        assert engine.runner.graph_runner is not None and engine.runner.graph_runner.graphs
        for i, p in enumerate(_prompts(6)):
            engine.add_request(str(i), p, params)
        finals, overlapped = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
            overlapped += engine._inflight is not None and bool(engine._inflight.seqs)
        assert (overlapped > 5) is mode
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results[mode] = finals
    assert results[True] == results[False]


def test_steady_async_decode_never_synchronizes(h200_art):
    assert LLMEngine(h200_art, device="cuda", num_kv_blocks=8).async_scheduling is True  # the CUDA default
    engine = LLMEngine(h200_art, device="cuda", num_kv_blocks=128, max_num_seqs=16)
    for i, p in enumerate(_prompts(8)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(6):  # prefill, then decode steps in flight
        engine.step()
    assert all(s.is_decoding for s in engine.scheduler.running) and len(engine.scheduler.running) == 8
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(8):
                engine.step()
                assert engine._inflight is not None and len(engine._inflight.seqs) == 8
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs[:3]


def test_sampling_on_cuda_seeded_penalised_and_logprobs(h200_art):
    # The sampler's generators live on the logits' device: temperature/top-p sampling, seeded requests
    # (reproducible whatever shares the batch), penalties and logprobs all run on CUDA tensors.
    engine = LLMEngine(h200_art, device="cuda", num_kv_blocks=128, max_num_seqs=16)
    prompts = _prompts(5)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    others = [SamplingParams(max_tokens=10, temperature=1.0, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)]

    def run(batch):
        finals = {}
        for rid, p, sp in batch:
            engine.add_request(rid, p, sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
        return finals

    alone = run([("s", prompts[0], seeded)])["s"].token_ids
    mixed = run([("s", prompts[0], seeded)] + [(f"o{i}", prompts[i + 1], sp) for i, sp in enumerate(others)])
    assert mixed["s"].token_ids == alone
    assert all(len(o.token_ids) == 10 for o in mixed.values())
    lp = mixed["o2"].logprobs
    assert lp is not None and len(lp) == 10 and all(len(step) >= 1 for step in lp)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
