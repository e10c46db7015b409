"""kiln.passes: one pass per module (imported here so each registers), and the per-target pipeline."""
from kiln.passes import (  # noqa: F401 - imported to register the passes
    cuda_graph_plan,
    dead_code_elimination,
    fuse_add_rms_norm,
    fuse_all_reduce_add_rms_norm,
    fuse_dequant_linear,
    fuse_expert_gate_up,
    fuse_gate_up,
    fuse_qkv,
    fuse_rope_kv_write,
    fuse_silu_mul,
    kernel_selection,
    lora_injection,
    mla_absorption,
    place_parallel,
    quantize_kv_cache,
    quantize_weights,
    shape_inference,
    vocab_parallel_sampling,
)
from kiln.passes.pipeline import build_pipeline

__all__ = ["build_pipeline"]
