"""The target registry: each compile target's datasheet figures, what it can build, its kernel libraries and
its pass pipeline. The one list of targets: the DSL, the driver, the passes and codegen ask it."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from kiln.dsl.errors import KilnError


class TargetError(KilnError):
    """A target kiln does not know, or an option the target cannot build (compiler/support.py)."""


# Tokens one scheduler step computes, decodes and prefill chunks together, on a target that does not say otherwise
# (Target.max_batched_tokens): vLLM's GPU server default with chunked prefill.
DEFAULT_STEP_BUDGET = 8192


@dataclass(frozen=True, slots=True)
class Target:
    """A compile target: its datasheet figures (kernel selection's costs, the capacity planner), what it can
    build (its fields; compiler/support.py checks a recipe's options against them), its kernel libraries and its
    pipeline. Adding a target is a `register_target` here plus its kernel table (passes/kernel_selection.py
    `register_kernels`)."""

    name: str
    description: str
    memory_bytes: int  # device memory the KV pool and weights share
    bandwidth: float  # bytes/s, nominal peak memory bandwidth
    bf16_flops: float  # dense tensor-core (or SIMD) peak, FLOP/s
    fp8_flops: float
    device: str  # what its artifacts load on: "cpu" or "cuda" (the manifest records it for the runtime)
    kernel_modules: tuple[str, ...]  # codegen kernel libraries the artifact carries; model.py imports the first
    cuda_graphs: bool = False  # decode batches are captured as CUDA graphs (passes/cuda_graph_plan.py)
    # The KV pool's byte budget when it is fixed at compile time (the cpu target: host memory is shared with
    # everything else on the machine); None: the runtime sizes it at load from the device's memory, after the
    # weights, the activation peak and the CUDA-graph reserve (kv_cache.memory_fraction of the device).
    kv_pool_bytes: int | None = None
    pipeline: str = "llm"  # the pass pipeline (registered by `pipeline_module`, imported when first needed)
    pipeline_module: str = "kiln.passes"
    dtypes: frozenset[str] = frozenset({"fp32", "bf16", "fp16"})
    weight_schemes: frozenset[str] = frozenset({"fp8", "awq", "gptq"})  # quantize.weights kinds
    kv_schemes: frozenset[str] = frozenset({"fp8"})  # quantize.kv_cache
    draft_methods: tuple[str, ...] = ("mtp",)  # draft heads (named forwards) it runs
    max_devices: int = 1  # parallel: ranks (tp x dp) one artifact spans
    # bytes/s one device sends to the others (NVLink; on cpu, gloo over loopback): the report's communication
    # floor per decode step (compiler/report.py)
    interconnect_bandwidth: float = 0.0
    interconnect: str = ""
    # The scheduler's step budget when a recipe leaves scheduler.max_batched_tokens out (compiler/options.py fills
    # it in; the manifest, the report and the runtime see the filled-in value), and why it is not the default
    # (`kiln recipe from-hf` writes the reason into the recipes it generates).
    max_batched_tokens: int = DEFAULT_STEP_BUDGET
    step_budget_reason: str = ""

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    if target.name in TARGETS and TARGETS[target.name] != target:
        raise TargetError(f"target {target.name!r} is registered twice")
    TARGETS[target.name] = target
    return target


# Datasheet numbers (dense, no sparsity): NVIDIA H100 SXM5 80GB and H200 SXM 141GB. Triton kernels, and the
# cpu (torch) library for what they have no kernel for.
# NVLink 4 (900 GB/s per GPU) across the 8 GPUs of one HGX node.
register_target(Target("h100", "NVIDIA H100 SXM (sm_90)", 80 * 10**9, 3.35e12, 989e12, 1979e12, device="cuda",
                       kernel_modules=("triton", "cpu"), cuda_graphs=True, max_devices=8,
                       interconnect_bandwidth=900e9, interconnect="NVLink"))
register_target(Target("h200", "NVIDIA H200 SXM (sm_90)", 141 * 10**9, 4.8e12, 989e12, 1979e12, device="cuda",
                       kernel_modules=("triton", "cpu"), cuda_graphs=True, max_devices=8,
                       interconnect_bandwidth=900e9, interconnect="NVLink"))
# A nominal small CPU host (the machines kiln's CI runs on): 2 cores, 24 GiB, ~20 GB/s, ~0.2 TFLOP/s fp32. Ranks are
# processes on the host talking gloo over loopback TCP (nominal 5 GB/s).
# 2048 tokens a step (vLLM's CPU server default): a step of 8192 prompt tokens takes seconds on a CPU and every running
# stream waits for it. Served at concurrency 64 on a 108 M model (docs/performance.md, "The step budget on a CPU"):
# 8192 -> 162 tok/s, median TTFT 14.5 s; 2048 -> 174 tok/s, 8.6 s; 1024 -> 178 tok/s, 7.6 s. 1024 was better still on
# that 2-core host, but a bigger CPU computes a step of the same tokens sooner: `kiln serve --max-num-batched-tokens`
# is the knob there.
register_target(Target("cpu", "CPU (apache-tvm kernels + torch; nominal 2-core host)", 24 * 2**30, 20e9, 0.2e12, 0.2e12,
                       device="cpu", kernel_modules=("tvm", "cpu"), kv_pool_bytes=256 * 2**20, max_devices=8,
                       interconnect_bandwidth=5e9, interconnect="gloo (loopback TCP)", max_batched_tokens=2048,
                       step_budget_reason=f"a step of {DEFAULT_STEP_BUDGET} prompt tokens stalls every running stream "
                                          "for seconds on a CPU"))


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(TARGETS), n=1)
        raise TargetError(f"unknown target {name!r}" + (f" — did you mean '{close[0]}'?" if close else "")
                          + f" (known: {', '.join(TARGETS)})") from None
