"""The engine's seam to whatever runs the model: `Executor`, and `create_executor`, which picks one for an artifact.

A single-device artifact runs in the engine's process on a `ModelRunner`. A parallel artifact (manifest
`parallel`) runs on a mesh executor (runtime/worker/distributed/): rank 0 in the engine's process, the other ranks as
worker processes over torch.distributed (or, `backend="local"`, as threads of this process sharing one device:
the single-process mesh). The engine sees the same interface either way; only the executor knows the ranks.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ..config import SchedulerConfig
from ..core.batch import ScheduledBatch
from ..errors import KilnRuntimeError
from .interface import Executor
from .memory_plan import plan_engine_pool
from .model_runner import ModelRunner


@contextmanager
def shutdown_on_error(executor: Executor):
    """Shuts `executor` down if the block raises (what is built on it refused), so its processes do not outlive it."""
    try:
        yield executor
    except BaseException:
        executor.shutdown()
        raise


def create_executor(artifact: Any, sched: SchedulerConfig, *, num_kv_blocks: int | None = None,
                    kv_cache_bytes: int | None = None, enforce_eager: bool = False,
                    backend: str | None = None, proposer: Any = None) -> Executor:
    """The executor of a loaded artifact, its KV pool sized (`plan_memory`, sharing the budget with a speculative
    `proposer`'s speculative.PoolShare) and allocated.

    `backend` (parallel artifacts): "mp" (default) — one worker process per rank > 0, or those a torchrun-style
    launch started (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT in the environment); "local" — every rank in this
    process (the single-process mesh)."""
    kv = artifact.kv_cache_config
    if artifact.world_size > 1:
        from .distributed.executor import create_mesh_executor

        return create_mesh_executor(artifact, sched, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                                    backend=backend, proposer=proposer)
    if backend not in (None, "mp", "local"):
        raise KilnRuntimeError(f"unknown executor backend {backend!r} (known: mp, local)")
    graphs = artifact.cuda_graph_config if artifact.device.type == "cuda" and not enforce_eager else None
    plan = plan_engine_pool(artifact, sched, graphs, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                            proposer=proposer)
    num_swap_blocks = sched.swap_space // kv.bytes_per_block if sched.preemption == "swap" else 0
    runner = ModelRunner(artifact.model, kv, plan["kv_blocks"], artifact.device, num_swap_blocks, graphs)
    runner.memory_plan = plan  # what the pool was sized from (benchmarks/gpu_engine.py prints it)
    return runner


def apply_swaps(executor: Executor, batch: ScheduledBatch) -> ScheduledBatch:
    """Copies the batch's swapped KV blocks now and returns it without swaps: a launch that fails and runs again
    (the engine's isolation) must not copy them twice (a block swapped out may be rewritten by this very step)."""
    if not (batch.swap_out or batch.swap_in):
        return batch
    executor.swap(batch)
    return replace(batch, swap_out=[], swap_in=[])
