"""Compile targets and their datasheet figures, used by kernel selection and the capacity planner."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.dsl.errors import KilnError


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    description: str
    memory_bytes: int  # device memory the KV pool and weights share
    bandwidth: float  # bytes/s, nominal peak memory bandwidth
    bf16_flops: float  # dense tensor-core (or SIMD) peak, FLOP/s
    fp8_flops: float
    gpu: bool
    cuda_graphs: bool = False  # decode batches are captured as CUDA graphs (passes/cuda_graph_plan.py)
    # The KV pool's byte budget when it is fixed at compile time (the cpu target: host memory is shared with
    # everything else on the machine); None: the runtime sizes it at load from the device's memory, after the
    # weights, the activation peak and the CUDA-graph reserve (kv_cache.memory_fraction of the device).
    kv_pool_bytes: int | None = None
    pipeline: str = "llm"  # the pass pipeline (registered by `pipeline_module`, imported when first needed)
    pipeline_module: str = "kiln.passes"


TARGETS: dict[str, Target] = {
    # Datasheet numbers (dense, no sparsity): NVIDIA H100 SXM5 80GB and H200 SXM 141GB.
    "h100": Target("h100", "NVIDIA H100 SXM (sm_90)", 80 * 10**9, 3.35e12, 989e12, 1979e12, gpu=True,
                   cuda_graphs=True),
    "h200": Target("h200", "NVIDIA H200 SXM (sm_90)", 141 * 10**9, 4.8e12, 989e12, 1979e12, gpu=True,
                   cuda_graphs=True),
    # A nominal small CPU host (the machines kiln's CI runs on): 2 cores, 24 GiB, ~20 GB/s, ~0.2 TFLOP/s fp32.
    "cpu": Target("cpu", "CPU (torch eager; nominal 2-core host)", 24 * 2**30, 20e9, 0.2e12, 0.2e12, gpu=False,
                  kv_pool_bytes=256 * 2**20),
}


class TargetError(KilnError):
    """A target kiln does not know, or an option the target cannot build (Target.supports)."""


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise TargetError(f"unknown target {name!r} (known: {', '.join(TARGETS)})") from None
