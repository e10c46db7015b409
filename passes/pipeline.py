"""The one ordered pass list per target."""
from __future__ import annotations

from collections.abc import Iterable

from kiln.compiler import Pass, PassManager, register_pipeline
from kiln.compiler.targets import Target
from kiln.passes.cuda_graph_plan import CUDAGraphPlan
from kiln.passes.dead_code_elimination import DeadCodeElimination
from kiln.passes.fuse_add_rms_norm import FuseAddRMSNorm
from kiln.passes.fuse_all_reduce_add_rms_norm import FuseAllReduceAddRMSNorm
from kiln.passes.fuse_dequant_linear import FuseDequantLinear
from kiln.passes.fuse_expert_gate_up import FuseExpertGateUp
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_qkv import FuseQKV
from kiln.passes.fuse_rope_kv_write import FuseRopeKVWrite
from kiln.passes.fuse_silu_mul import FuseSiLUMul
from kiln.passes.kernel_selection import KERNEL_TABLES, KernelSelection
from kiln.passes.mla_absorption import MLAAbsorption
from kiln.passes.place_parallel import PlaceParallel
from kiln.passes.quantize_kv_cache import QuantizeKVCache
from kiln.passes.quantize_weights import QuantizeWeights
from kiln.passes.shape_inference import ShapeInference


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
        # Phase 4: cleanup (fusions keep the IR typed, so shape inference need not run again)
        DeadCodeElimination(),
        # Phase 5: lowering, on targets with a kernel table
        *([KernelSelection(target.name)] if target.name in KERNEL_TABLES else []),
        # Phase 6: runtime planning (targets that capture CUDA graphs: buckets and static buffers for decode)
        *([CUDAGraphPlan()] if target.cuda_graphs else []),
    ]


register_pipeline("llm", _llm)


def build_pipeline(target: str, disable: Iterable[str] = ()) -> list[Pass]:
    """The passes `target` runs, in order, without those named in `disable` (checked like PassManager.remove)."""
    pm = PassManager.for_target(target)
    for name in disable:
        pm.remove(name)
    return pm.passes
