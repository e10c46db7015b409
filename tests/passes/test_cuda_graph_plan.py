"""cuda_graph_plan: the decode capture plan lands in program.meta["cuda_graph_plan"] (and the manifest's
`cuda_graphs`); the graphs never change."""
import dataclasses

import pytest
from kiln.compiler import PassError
from kiln.compiler.options import CUDA_GRAPH_PLAN, CudaGraphsOptions
from kiln.passes.cuda_graph_plan import CUDAGraphPlan
from pass_testlib import assert_programs_equal, run_pass, typed

BEFORE = """
program p dtype=f32 {
  config {}
  param w: f32[16, 8] from ["w"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "w" : f32[16, 8]
    %y = linear(%x, %w)
    %z = silu(%y)
    return %z
  }
}
"""


def _with_meta(**meta):
    return dataclasses.replace(typed(BEFORE), meta=meta)


def test_plan_recorded_in_meta_graphs_unchanged():
    before = _with_meta(cuda_graphs={"batch_sizes": [8, 1, 4]}, kv_cache={"block_size": 16},
                        serve={"max_model_len": 100}, scheduler={"max_seqs": 8})
    out, ctx = run_pass(CUDAGraphPlan(), before)
    assert_programs_equal(out, typed(BEFORE))  # expected = before: only the meta changes
    assert "cuda_graphs" in before.meta and "static_buffers" not in before.meta["cuda_graphs"]
    plan = out.meta[CUDA_GRAPH_PLAN]
    assert plan["batch_sizes"] == [1, 4, 8] and plan["max_batch_size"] == 8
    assert plan["max_model_len"] == 100 and plan["max_blocks_per_seq"] == 7  # ceil(100 / 16)
    buffers = plan["static_buffers"]
    assert buffers["block_tables"] == {"shape": [8, 7], "dtype": "int32"}
    assert buffers["slot_mapping"] == {"shape": [8], "dtype": "int64"}
    assert buffers["query_start_loc"]["shape"] == [9] and buffers["logits"] == {"shape": [8, 16], "dtype": "float32"}
    static = 4 * (8 * 4 + 8 * 7 + 9) + 8 * 8 + 4 * 8 * 16
    assert plan["estimated_bytes"] == static + 8 * (16 * 4 + 16 * 4)  # linear + silu outputs, per token
    assert ctx.stats["buckets"] == 3
    again, _ = run_pass(CUDAGraphPlan(), out)
    assert again is out  # nothing left to plan


def test_default_buckets_capped_by_max_seqs():
    out, _ = run_pass(CUDAGraphPlan(), _with_meta(scheduler={"max_seqs": 48}))
    assert out.meta[CUDA_GRAPH_PLAN]["batch_sizes"] == [1, 2, 4, 8, 16, 32]
    out, _ = run_pass(CUDAGraphPlan(), _with_meta())
    assert out.meta[CUDA_GRAPH_PLAN]["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert out.meta[CUDA_GRAPH_PLAN]["max_blocks_per_seq"] == 4096 // 16


@pytest.mark.parametrize("sizes, message", [
    ([1, 2, 2], "batch size 2 is listed twice"),
    ([1, 512], "batch size 512 exceeds scheduler.max_seqs = 256"),
    ([0, 4], "batch size 0 is not a positive int"),
    ([], "non-empty list"),
])
def test_bad_buckets_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        CudaGraphsOptions(tuple(sizes)).buckets(256)
    with pytest.raises(PassError, match=f"cuda_graphs.batch_sizes: .*{message}"):
        CUDAGraphPlan().run(_with_meta(cuda_graphs={"batch_sizes": sizes}), None)
