"""CUDAGraphRunner on CPU: bucketing, padding into the scratch block, eager fallback, and padded decode equal to
unpadded eager decode on a compiled tiny Llama. "Replay" here is an eager forward over the padded static
buffers (capture needs CUDA: tests/gpu/test_cuda_graphs_gpu.py)."""
from __future__ import annotations

import pytest
import torch
from kiln.runtime import LLMEngine
from kiln.runtime.config import CUDAGraphConfig
from kiln.runtime.core.batch import cdiv
from kiln.runtime.forward_batch import ForwardBatch
from kiln.runtime.worker.graph_runner import CUDAGraphRunner
from kiln.runtime.worker.model_runner import ModelRunner

BUCKETS = (1, 2, 4, 8)


class RecordingModel:
    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch, kv_caches):
        self.batches.append(batch)
        return batch.input_ids.float()[:, None].repeat(1, 3)


def _decode_batch(n: int, width: int = 2) -> ForwardBatch:
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return ForwardBatch(input_ids=i32([10 + i for i in range(n)]), positions=i32([5] * n),
                        query_start_loc=i32(list(range(n + 1))), seq_lens=i32([6] * n),
                        block_tables=i32([[2 * i, 2 * i + 1][:width] for i in range(n)]),
                        slot_mapping=torch.tensor([16 * 2 * i + 5 for i in range(n)], dtype=torch.int64),
                        logits_indices=i32(list(range(n))), num_decodes=n)


def _runner(model) -> CUDAGraphRunner:
    return CUDAGraphRunner(model, [], BUCKETS, max_blocks=4, block_size=16, scratch_block=99,
                           device=torch.device("cpu"))


def test_bucket_selection():
    r = _runner(RecordingModel())
    assert [r.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 300)] == [1, 2, 4, 4, 8, 8, None, None]


def test_padding_rows_live_in_the_scratch_block():
    model = RecordingModel()
    r = _runner(model)
    logits = r.run(_decode_batch(3))
    assert logits.shape == (3, 3) and logits[:, 0].tolist() == [10, 11, 12]
    (seen,) = model.batches
    assert seen.num_seqs == 4 and seen.num_decodes == 4 and seen.input_ids.data_ptr() == r.input_ids.data_ptr()
    assert seen.input_ids.tolist() == [10, 11, 12, 0] and seen.positions.tolist() == [5, 5, 5, 0]
    assert seen.seq_lens.tolist() == [6, 6, 6, 1]
    assert seen.slot_mapping.tolist() == [5, 37, 69, 99 * 16]
    assert seen.block_tables.tolist() == [[0, 1, 99, 99], [2, 3, 99, 99], [4, 5, 99, 99], [99] * 4]
    assert seen.query_start_loc.tolist() == [0, 1, 2, 3, 4] and seen.logits_indices.tolist() == [0, 1, 2, 3]
    r.run(_decode_batch(5))
    r.run(_decode_batch(3, width=1))  # after a larger batch: its stale rows in the bucket are padding again
    last = model.batches[-1]
    assert last.seq_lens.tolist() == [6, 6, 6, 1] and last.slot_mapping[3] == 99 * 16
    assert last.block_tables.tolist() == [[0, 99, 99, 99], [2, 99, 99, 99], [4, 99, 99, 99], [99] * 4]


def test_prefill_and_oversize_batches_fall_back_to_eager():
    model = RecordingModel()
    r = _runner(model)
    assert r.run(_decode_batch(9)) is None
    prefill = _decode_batch(2)
    prefill.num_decodes = 1
    assert r.run(prefill) is None
    lora = _decode_batch(2)
    lora.lora_ids = torch.zeros(2, dtype=torch.int32)
    assert r.run(lora) is None
    assert not model.batches


@pytest.fixture(scope="module")
def llama(compile_hf):
    _, art, _ = compile_hf("llama")
    return art


def _engine(art, graphs: bool) -> LLMEngine:
    engine = LLMEngine(art, num_kv_blocks=64, max_num_seqs=16)
    if graphs:  # what a CUDA load does, minus the capture
        a = engine.artifact
        cfg = CUDAGraphConfig(BUCKETS, cdiv(a.model_config.max_model_len, a.kv_cache_config.block_size))
        engine.runner = ModelRunner(a.model, a.kv_cache_config, engine.block_manager.num_blocks, a.device,
                                    cuda_graphs=cfg, capture_graphs=False)
    steps: list[tuple[int, bool, torch.Tensor]] = []
    execute, runner = engine.runner.execute, engine.runner

    def recording_execute(batch):
        logits, layout = execute(batch)
        steps.append((len(batch.seqs), batch.num_decodes == len(batch.seqs), logits.clone()))
        return logits, layout

    runner.execute = recording_execute
    engine.steps = steps
    return engine


def test_padded_decode_equals_eager_decode(llama, run_engine):
    g = torch.Generator().manual_seed(0)
    # 11 sequences: decode batches of 11 (over the largest bucket: eager), then 7, 6, 3 (padded to 8, 8, 4), 1
    max_tokens = [4, 4, 4, 4, 6, 8, 8, 8, 10, 10, 12]
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 30, 2, 7, 11, 4, 21, 6)]
    eager, padded = _engine(llama, graphs=False), _engine(llama, graphs=True)
    want, got = run_engine(eager, prompts, max_tokens), run_engine(padded, prompts, max_tokens)
    for w, o in zip(want, got, strict=True):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        # Same top tokens; values equal up to GEMM rounding (a GEMM over 8 rows may block differently than
        # over 7, so logits agree to ~1e-6, not bitwise)
        for lw, lo in zip(w.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
            assert list(lo) == list(lw)
            assert all(abs(lo[t].logprob - lw[t].logprob) < 1e-5 for t in lw)
    assert [s[:2] for s in padded.steps] == [s[:2] for s in eager.steps]
    for (n, _, a), (_, _, b) in zip(eager.steps, padded.steps, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=f"batch of {n}")
    decode_sizes = {n for n, decode, _ in padded.steps if decode}
    assert {3, 7, 11} <= decode_sizes  # padded buckets and the eager fallback both ran
    runner = padded.runner.graph_runner
    scratch = padded.runner.kv_caches[0][runner.scratch_block]
    assert scratch.abs().sum() > 0  # padding rows wrote there, and only there (the outputs match)
    assert len(padded.runner.kv_caches[0]) == padded.block_manager.num_blocks + 1
