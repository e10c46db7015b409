"""The one ordered pass list per target."""
from __future__ import annotations

from collections.abc import Iterable

from kiln.compiler import Pass, PassManager, register_pipeline
from kiln.compiler.options import RecipeOptions
from kiln.compiler.targets import Target
from kiln.passes.cuda_graph_plan import CUDAGraphPlan
from kiln.passes.dead_code_elimination import DeadCodeElimination
from kiln.passes.embed_output import EmbedOutput
from kiln.passes.fuse_add_rms_norm import FuseAddRMSNorm
from kiln.passes.fuse_all_reduce_add_rms_norm import FuseAllReduceAddRMSNorm
from kiln.passes.fuse_dequant_linear import FuseDequantLinear
from kiln.passes.fuse_expert_gate_up import FuseExpertGateUp
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_qkv import FuseQKV
from kiln.passes.fuse_rope_kv_write import FuseRopeKVWrite
from kiln.passes.fuse_silu_mul import FuseSiLUMul
from kiln.passes.kernel_selection import KERNEL_TABLES, KernelSelection
from kiln.passes.lora_injection import LoRAInjection
from kiln.passes.mla_absorption import MLAAbsorption
from kiln.passes.place_parallel import PlaceParallel
from kiln.passes.quantize_kv_cache import QuantizeKVCache
from kiln.passes.quantize_weights import QuantizeWeights
from kiln.passes.shape_inference import ShapeInference
from kiln.passes.vocab_parallel_sampling import VocabParallelSampling


def _llm(target: Target) -> list[Pass]:
    """The LLM pipeline, every target's. Ordering constraints are declared by the passes themselves
    (register_pass after=/before=/requires=) and checked by the PassManager; the comments say why."""
    return [
        # Phase 1: analysis
        ShapeInference(),
        # Phase 2: quantization (recipe `quantize { }`; no-ops without it). Before fusion: fuse_qkv and
        # fuse_gate_up merge quantized siblings where the concatenation is exact (fp8, AWQ; not GPTQ)
        QuantizeWeights(),
        # Phase 2: fusion (gate_up before silu_mul: silu_mul matches the slices gate_up leaves)
        FuseQKV(),
        FuseGateUp(),
        FuseExpertGateUp(),
        FuseSiLUMul(),
        FuseAddRMSNorm(),
        MLAAbsorption(),  # decode attends over the MLA latent; prefill keeps per-head K/V
        FuseDequantLinear(),  # linear(x, dequant(w_q...)) -> one quantized GEMM
        QuantizeKVCache(),  # after fuse_qkv, which matches the plain three-input attention
        FuseRopeKVWrite(),  # after quantize_kv_cache: fp8 KV calibration observes the attention's roped k
        # Phase 3: parallelism placement (recipe `parallel { }`; no-ops on one device). After fusion: fused
        # q/k/v and gate/up projections are sharded per segment
        PlaceParallel(),
        FuseAllReduceAddRMSNorm(),  # the row-parallel reduction with the residual add + RMSNorm after it
        VocabParallelSampling(),  # the LM head's gather: only each row's top candidates when that is all a step needs
        # Phase 4: cleanup (fusions keep the IR typed, so shape inference need not run again)
        DeadCodeElimination(),
        # Phase 5: lowering, on targets with a kernel table
        *([KernelSelection(target.name)] if target.name in KERNEL_TABLES else []),
        # Phase 6: runtime planning (targets that capture CUDA graphs: buckets and static buffers for decode)
        *([CUDAGraphPlan()] if target.cuda_graphs else []),
    ]


register_pipeline("llm", _llm)


def add_recipe_passes(pm: PassManager, options: RecipeOptions) -> None:
    """The passes a recipe section switches on, inserted into `pm` (left out of the list otherwise, so a recipe
    without the section compiles exactly as before): `lora { }` -> lora_injection, after fusion (it adapts a
    fused q/k/v or gate/up linear as one) and before cleanup and kernel selection."""
    if "lora" in options.set_sections:
        anchor = next((a for a in ("dead_code_elimination", "kernel_selection") if a in pm.names), None)
        if anchor is None:  # a recipe disabled both: last
            pm.insert_after(pm.names[-1], LoRAInjection())
        else:
            pm.insert_before(anchor, LoRAInjection())
    if options.task == "embed":  # the entry returns the normed hidden rows instead of logits
        anchor = next((a for a in ("dead_code_elimination", "kernel_selection") if a in pm.names), None)
        if anchor is None:
            pm.insert_after(pm.names[-1], EmbedOutput())
        else:
            pm.insert_before(anchor, EmbedOutput())


def build_pipeline(target: str, disable: Iterable[str] = ()) -> list[Pass]:
    """The passes `target` runs, in order, without those named in `disable` (checked like PassManager.remove)."""
    pm = PassManager.for_target(target)
    for name in disable:
        pm.remove(name)
    return pm.passes
