"""Plans CUDA-graph capture for decode: batch-size buckets, static input buffers, a graph-memory estimate."""
from __future__ import annotations

import dataclasses
from typing import Any

from kiln.compiler import Pass, PassContext, PassError, Program, TensorType, register_pass
from kiln.compiler.kv_layout import step_activation_bytes
from kiln.compiler.options import CUDA_GRAPH_PLAN as PLAN
from kiln.compiler.options import DEFAULT_MAX_MODEL_LEN, RecipeOptions


def plan_cuda_graphs(program: Program, batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    """The manifest's `cuda_graphs` section for `batch_sizes` (see CUDAGraphPlan)."""
    options = RecipeOptions.from_meta(program.meta)
    block_size = options.kv_cache.block_size
    max_len = int(options.serve.max_model_len or program.config.get("max_position") or DEFAULT_MAX_MODEL_LEN)
    max_bs = batch_sizes[-1]
    max_blocks = -(-max_len // block_size)
    out = program.entry.node(program.entry.outputs[0]).out
    vocab = out.shape[-1] if isinstance(out, TensorType) and isinstance(out.shape[-1], int) else \
        int(program.config.get("vocab", 0) or program.config.get("vocab_size", 0))
    buffers = {
        "input_ids": ([max_bs], "int32"), "positions": ([max_bs], "int32"), "seq_lens": ([max_bs], "int32"),
        "block_tables": ([max_bs, max_blocks], "int32"), "slot_mapping": ([max_bs], "int64"),
        "query_start_loc": ([max_bs + 1], "int32"), "logits_indices": ([max_bs], "int32"),
        "logits": ([max_bs, vocab], "float32"),
    }
    elem = {"int32": 4, "int64": 8, "float32": 4}
    static_bytes = sum(elem[dt] * _numel(shape) for shape, dt in buffers.values())
    # The graphs share one memory pool, captured largest first: it holds the largest bucket's activations.
    # Within a layer everything may be live at once; across layers the allocator reuses the same blocks.
    return {
        "batch_sizes": list(batch_sizes),
        "max_batch_size": max_bs,
        "max_model_len": max_len,
        "block_size": block_size,
        "max_blocks_per_seq": max_blocks,
        "static_buffers": {name: {"shape": shape, "dtype": dt} for name, (shape, dt) in buffers.items()},
        "estimated_bytes": static_bytes + step_activation_bytes(program, max_bs),
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# after every rewrite: its graph-memory estimate reads the final IR
@register_pass("cuda_graph_plan", requires=("shape_inference",), after=("kernel_selection", "dead_code_elimination"))
class CUDAGraphPlan(Pass):
    """Requires: typed IR; GPU targets only (pipeline.py adds it to h100/h200). Guarantees: the graphs are
    unchanged; `program.meta["cuda_graph_plan"]` is the capture plan the runtime follows — `batch_sizes` (the
    recipe's `cuda_graphs { batch_sizes = [...] }`, else 1, 2, 4, ..., 256 up to scheduler.max_seqs), the
    static buffer shapes (block_tables [max_batch_size, max_blocks_per_seq], max_blocks_per_seq =
    ceil(max_model_len / block_size)) and `estimated_bytes` of graph memory (static buffers + the largest
    bucket's activations). Bad buckets are a PassError (the driver reports them at the recipe's location)."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        options = RecipeOptions.from_meta(program.meta)
        try:
            sizes = options.cuda_graphs.buckets(options.scheduler.max_seqs)
        except ValueError as e:
            raise PassError(f"cuda_graphs.batch_sizes: {e}") from None
        plan = plan_cuda_graphs(program, sizes)
        ctx.stats["buckets"] = len(sizes)
        if program.meta.get(PLAN) == plan:
            return program
        return dataclasses.replace(program, meta={**program.meta, PLAN: plan})
