"""The target registry: each compile target's datasheet figures, what it can build, its kernel libraries and
its pass pipeline. The one list of targets: the DSL, the driver, the passes and codegen ask it."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.dsl.errors import KilnError, SourceError

if TYPE_CHECKING:
    from kiln.compiler.options import RecipeOptions


class TargetError(KilnError):
    """A target kiln does not know, or an option the target cannot build (Target.supports)."""


# Tokens one scheduler step computes, decodes and prefill chunks together, on a target that does not say otherwise
# (Target.max_batched_tokens): vLLM's GPU server default with chunked prefill.
DEFAULT_STEP_BUDGET = 8192


@dataclass(frozen=True, slots=True)
class Target:
    """A compile target: its datasheet figures (kernel selection's costs, the capacity planner), what it can
    build (`supports`), its kernel libraries and its pipeline. Adding a target is a `register_target` here plus
    its kernel table (passes/kernel_selection.py `register_kernels`)."""

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

    def supports(self, options: RecipeOptions) -> None:
        """Refuses, at the option's place in the recipe, what this target cannot build (or kiln not yet).
        `kiln compile` runs it with and without -o: a plan is made only for what could be built."""
        def refuse(message: str, key: str) -> None:
            raise TargetError(message) if options.loc(key) is None else SourceError(message, options.loc(key))

        if options.dtype not in self.dtypes:
            refuse(f"target {self.name} has no {options.dtype} kernels (dtypes: {', '.join(sorted(self.dtypes))})",
                   "dtype")
        for section, what in _NOT_YET.items():
            if section in options.set_sections:
                refuse(what, section)
        dis = options.disaggregate
        if dis.decode > 1:
            refuse(f"disaggregate.decode = {dis.decode}: more than one decode core behind one router is not "
                   "implemented yet (`kiln serve ART --disaggregate --replicas N` runs N prefill + decode replicas)",
                   "disaggregate.decode")
        if options.kv_cache.offload is not None and options.scheduler.prefix_cache == "none":
            refuse("kv_cache.offload keeps the blocks the prefix cache evicts: it needs scheduler.prefix_cache = "
                   "radix", "kv_cache.offload")
        if options.kv_cache.offload is not None and options.parallel.dp > 1:
            # tensor parallelism is served (every rank offloads its slice of the same blocks, runtime/worker/distributed/
            # kv_offload.py); under data-parallel attention a block's KV is on one rank, its sequence's
            refuse(f"kv_cache.offload with data-parallel attention (parallel.dp = {options.parallel.dp}) is not "
                   "implemented yet: each block's KV is on the one rank running its sequence, so a restore would "
                   "have to move it to the rank the returning sequence is placed on (tp meshes are served)",
                   "kv_cache.offload")
        self._supports_mesh(options, refuse)
        q = options.quantize
        if q.weights is not None:
            if q.weights.kind not in self.weight_schemes:
                refuse(f"quantize.weights: target {self.name} has no {q.weights.kind} kernels", "quantize.weights")
        if q.kv_cache is not None and "fp8" not in self.kv_schemes:
            refuse(f"quantize.kv_cache: target {self.name} has no fp8 KV cache", "quantize.kv_cache")
        spec = options.speculative
        if (spec.draft is not None) != (spec.method in CHECKPOINT_METHODS):
            refuse("a separate draft model is `speculative { method = draft; draft = \"hf:DIR\" }`, the checkpoint "
                   "of a smaller model sharing the tokenizer, an EAGLE head `method = eagle; draft = \"hf:DIR\"` "
                   "(method = ngram needs no model, method = mtp uses the model's own MTP head)",
                   "speculative.draft" if spec.draft is not None else "speculative.method")
        if spec.method is not None and spec.method not in MODEL_FREE_METHODS:
            if spec.method not in self.draft_methods:
                refuse(f"speculative decoding method {spec.method!r} is not implemented yet (kiln builds: "
                       f"{', '.join(MODEL_FREE_METHODS)}, prompt lookup; {', '.join(self.draft_methods)}, a draft "
                       "head compiled into the model)", "speculative.method")
        if "lora" in options.set_sections:
            _lora_supported(options, refuse)
        # n-gram and draft-model drafts are tokens that rank 0 schedules as verify rows, on any mesh; a draft head
        # reads the target's hidden states, which data-parallel attention leaves on each sequence's rank
        if options.parallel.dp > 1 and spec.method in self.draft_methods:
            refuse(f"speculative.method = {spec.method} with data-parallel attention (parallel.dp > 1) is not "
                   "implemented yet: a draft head reads the target's hidden states, which stay on their ranks "
                   "(ngram and draft models work)", "speculative.method")
        if "cuda_graphs" in options.set_sections:
            if not self.cuda_graphs:
                capture = ", ".join(t.name for t in TARGETS.values() if t.cuda_graphs)
                refuse(f"cuda_graphs needs a GPU target ({capture}); the {self.name} target runs decode eagerly",
                       "cuda_graphs")
            try:
                options.cuda_graphs.buckets(options.scheduler.max_seqs)
            except ValueError as e:
                refuse(f"cuda_graphs.batch_sizes: {e}", "cuda_graphs.batch_sizes")


    def _supports_mesh(self, options: RecipeOptions, refuse) -> None:
        """`parallel { tp; dp; ep; pp }`: tp x dp ranks up to max_devices, ep dividing them; pipeline parallelism
        and tensor parallelism inside data-parallel attention groups are not built."""
        par = options.parallel
        if par.pp > 1:
            refuse(f"parallel.pp = {par.pp}: pipeline parallelism is not implemented (kiln places layers on one "
                   "rank each step; it builds tensor (tp), expert (ep) and data-parallel attention (dp) meshes)",
                   "parallel.pp")
        if par.tp > 1 and par.dp > 1:
            refuse(f"parallel: tp = {par.tp} with dp = {par.dp} (tensor-parallel attention inside data-parallel "
                   "groups) is not implemented yet; use tp or dp (MLPs are sharded over all tp x dp ranks)",
                   "parallel.dp")
        if par.dense == "replicated" and par.dp == 1:
            refuse("parallel.dense = replicated needs data-parallel attention (dp > 1): with tensor-parallel "
                   "attention every rank holds a slice of each row, not rows of its own", "parallel.dense")
        if par.world > self.max_devices:
            key = "parallel.tp" if par.tp > 1 else "parallel.dp"
            refuse(f"parallel: {par.world} ranks (tp x dp) exceed target {self.name}'s {self.max_devices} devices",
                   key)
        if par.world % par.ep:
            refuse(f"parallel.ep = {par.ep} must divide the {par.world} ranks (tp x dp = {par.tp} x {par.dp}): "
                   "experts are placed on ep groups of world / ep ranks", "parallel.ep")


def _lora_supported(options: RecipeOptions, refuse) -> None:
    """What LoRA serving composes with: prefix caching does (block keys include the adapter); speculative
    decoding by n-gram lookup or a draft model does (the verify rows are the sequence's, with its adapter; the
    drafts are proposals, so outputs stay exact); quantized base weights do (the branch reads the GEMM's input
    and adds to its output); tensor parallelism does (each rank holds its slice of the adapter slots: B's output
    rows of a column-parallel linear, A's input columns of a row-parallel one, whose partial branch the base's
    all_reduce sums). A draft head (mtp), data-parallel attention and expert parallelism are refused, at the
    section that asks."""
    method = options.speculative.method
    if method is not None and method not in MODEL_FREE_METHODS:
        refuse(f"LoRA with speculative method = {method} is not supported: the draft head reads the target's "
               "hidden states, which an adapter shifts away from the base model's it was trained on, and has no "
               "adapter of its own; use method = ngram or method = draft (exact with adapters)",
               "speculative.method")
    par = options.parallel
    if par.dp > 1:
        refuse(f"LoRA with parallel.dp = {par.dp} is not supported yet: data-parallel attention runs each rank's own "
               "sequences through attention but every rank's rows through the MLPs, and the adapter rows of a step "
               "are planned for one batch (tp composes with LoRA)", "parallel.dp")
    if par.ep > 1:
        refuse(f"LoRA with parallel.ep = {par.ep} is not supported yet: experts are not adapted, and expert-parallel "
               "groups would need adapter rows per group (tp composes with LoRA)", "parallel.ep")
    if options.lora.max_rank > 256:
        refuse(f"lora.max_rank = {options.lora.max_rank}: at most 256", "lora.max_rank")


# Recipe sections kiln parses but cannot build on any target yet: an error at the section, never ignored.
# speculative methods that need no draft head in the model (any k): n-gram prompt lookup, a separate draft model,
# an EAGLE head; the last two read a checkpoint of their own (`speculative.draft`)
MODEL_FREE_METHODS = ("ngram", "draft", "eagle")
CHECKPOINT_METHODS = ("draft", "eagle")

_NOT_YET = {
}

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
