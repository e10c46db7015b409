"""The emitter table: how model.py calls each kernel id that kernel selection may choose.

A template is a `str.format` string over:
  {0}, {1}, ...  the node's inputs (local names or expressions), {args} all of them comma-separated;
  {eps}, ...     the node's attributes as Python literals (op-table defaults filled in);
  {kv_cache}, {rope_cache}, {fused_rope}, {scale}, {attn_softcap}, {attn_sinks}, {expert_map},
  {expert_activation}, {gathered_size}, {dp_counts}
                 context fields
                 codegen derives for the node (see render.CONTEXT_FIELDS).
Collective kernels take the rank's communicator (`self.comm`, bound by the runtime; parallel artifacts only).
Adding a kernel is one row here (plus its function in a kernels template), never a branch in the renderer.
"""
from __future__ import annotations

# kernel module namespace (prefix of a kernel id) -> (kernels template, alias model.py imports it as)
KERNEL_MODULES: dict[str, tuple[str, str]] = {
    "cpu": ("cpu/kernels.py.j2", "K"),
    "tvm": ("tvm/library.py.j2", "K"),  # loads kernels/tvm_cpu/cpu.so (codegen/tvm_build.py builds it)
    "triton": ("triton/kernels.py.j2", "K"),  # rendered per model shape and dtype (see artifact.kernel_params)
}

EMITTERS: dict[str, str] = {
    "cpu.embedding": "K.embedding({0}, {1})",
    "cpu.rms_norm": "K.rms_norm({0}, {1}, eps={eps})",
    "cpu.add_rms_norm": "K.add_rms_norm({0}, {1}, {2}, eps={eps})",
    "cpu.linear": "K.linear({args})",
    "cpu.silu": "K.silu({0})",
    "cpu.gelu_tanh": "K.gelu_tanh({0})",
    "cpu.scale": "K.scale({0}, {factor})",
    "cpu.softcap": "K.softcap({0}, {cap})",
    "cpu.silu_mul": "K.silu_mul({0})",
    "cpu.add": "K.add({0}, {1})",
    "cpu.bias_add": "K.add({0}, {1})",  # torch broadcasts the bias over the rows
    "cpu.mul": "K.mul({0}, {1})",
    "cpu.concat": "K.concat({0}, {1})",
    "cpu.rope": "K.rope({0}, batch.positions, {rope_cache})",
    "cpu.paged_attention": ("K.paged_attention({0}, {1}, {2}, {kv_cache}, batch, scale={scale}, "
                            "sliding_window={sliding_window}{kv_scales}{fused_rope}{attn_softcap}{attn_sinks})"),
    "cpu.logits": "K.logits({0}, {1}, batch.logits_indices)",
    "cpu.hidden_rows": "{0}.index_select(0, batch.logits_indices).float()",  # task = embed (embed_output.py)
    "cpu.deinterleave": "K.deinterleave({0})",
    "cpu.dequant_fp8": "K.dequant_fp8({0}, {1}, granularity={granularity}, block={block}, dtype={dtype})",
    "cpu.linear_fp8": "K.linear_fp8({args}, granularity={granularity}, block={block}, act={act})",
    "cpu.dequant_int4": ("K.dequant_int4({args}, format={format}, group={group}, zero_offset={zero_offset}, "
                         "dtype={dtype})"),
    "cpu.linear_w4a16": "K.linear_w4a16({args}, format={format}, group={group}, zero_offset={zero_offset})",
    "cpu.mla_attention": ("K.mla_attention({0}, {1}, {2}, {3}, {4}, {kv_cache}, batch, scale={scale}, "
                          "absorb={absorb}{kv_scales})"),
    "cpu.moe_topk_softmax": "K.moe_topk_softmax({0}, top_k={top_k}, renormalize={renormalize})",
    "cpu.moe_topk_grouped": ("K.moe_topk_grouped({args}, top_k={top_k}, n_group={n_group}, topk_group={topk_group}, "
                             "routed_scaling={routed_scaling}, renormalize={renormalize}, scoring={scoring}, "
                             "group_score={group_score})"),
    "cpu.moe_experts": "K.moe_experts({args}{expert_map}{expert_activation})",
    "cpu.moe_experts_a2a": ("K.moe_experts_a2a({args}, comm=self.comm, experts_by_rank={expert_owners}"
                          "{expert_activation})"),
    # the adapters' rows of each token (batch.lora: slots and token segments, None without adapters)
    "cpu.lora": "K.lora({0}, {1}, batch.lora, {target}, layer)",
    # collectives (parallel programs): through the rank's communicator
    "cpu.all_reduce": "K.all_reduce({0}, self.comm)",
    "cpu.all_gather": "K.all_gather({0}, self.comm, dim={dim}, size={gathered_size})",
    "cpu.gather_logits": "K.gather_logits({0}, self.comm, batch.logit_candidates, size={gathered_size})",
    "cpu.dp_gather": "K.dp_gather({0}, self.comm, {dp_counts})",
    "cpu.dp_scatter": "K.dp_scatter({0}, self.comm, batch.dp_num_tokens)",
    "cpu.all_reduce_add_rms_norm": "K.all_reduce_add_rms_norm({0}, {1}, {2}, self.comm, eps={eps})",
    "cpu.vocab_parallel_embedding": "K.vocab_parallel_embedding({0}, {1}, self.rank)",
}

# cpu target, kernels built with apache-tvm (kernels/tvm.py, imported as K): the cpu library's signatures.
EMITTERS.update({
    "tvm.paged_attention": EMITTERS["cpu.paged_attention"],
    "tvm.add_rms_norm": EMITTERS["cpu.add_rms_norm"],
    "tvm.rms_norm": EMITTERS["cpu.rms_norm"],
    "tvm.silu_mul": EMITTERS["cpu.silu_mul"],
    "tvm.linear": EMITTERS["cpu.linear"],
    "tvm.logits": EMITTERS["cpu.logits"],
    "tvm.all_reduce_add_rms_norm": EMITTERS["cpu.all_reduce_add_rms_norm"],
    "tvm.embedding": EMITTERS["cpu.embedding"],  # also gathers rows of a table held packed for the LM head
})

# Kernels that read a weight in the tvm library's packed GEMM layout (kernels/tvm.py `PackedWeight`), and at
# which input. model.py packs a param once, when the model is built, and drops its [N, K] tensor, when every
# use of the param is one of these and at least one is a GEMM (`PACKED_WEIGHT_GEMMS`): each weight is then
# held once, in the layout the GEMM streams (a tied embedding's lookups gather rows from it).
PACKED_WEIGHT_READERS: dict[str, int] = {"tvm.linear": 1, "tvm.logits": 1, "tvm.embedding": 1}
PACKED_WEIGHT_GEMMS = frozenset({"tvm.linear", "tvm.logits"})

# GPU targets (kernels/triton.py, imported as K): same signatures as the cpu library, so the same calls.
EMITTERS.update({
    "triton.embedding": "K.embedding({0}, {1})",
    "triton.rms_norm": "K.rms_norm({0}, {1}, eps={eps})",
    "triton.add_rms_norm": "K.add_rms_norm({0}, {1}, {2}, eps={eps})",
    "triton.silu_mul": "K.silu_mul({0})",
    "triton.rope": "K.rope({0}, batch.positions, {rope_cache})",
    "triton.paged_attention": ("K.paged_attention({0}, {1}, {2}, {kv_cache}, batch, scale={scale}, "
                               "sliding_window={sliding_window}{kv_scales}{fused_rope}{attn_softcap}{attn_sinks})"),
    "triton.moe_experts": "K.moe_experts({args}{expert_map}{expert_activation})",
    "triton.all_reduce_add_rms_norm": "K.all_reduce_add_rms_norm({0}, {1}, {2}, self.comm, eps={eps})",
    "triton.mla_attention": ("K.mla_attention({0}, {1}, {2}, {3}, {4}, {kv_cache}, batch, scale={scale}, "
                             "absorb={absorb}{kv_scales})"),
    "triton.linear_fp8": "K.linear_fp8({args}, granularity={granularity}, block={block}, act={act})",
    "triton.linear_w4a16": "K.linear_w4a16({args}, format={format}, group={group}, zero_offset={zero_offset})",
    # segmented multi-LoRA shrink/expand: the cpu call plus each adapted module's output rows (its slices; a
    # rank's share of them under tensor parallelism)
    "triton.lora": "K.lora({0}, {1}, batch.lora, {target}, layer, rows={lora_rows})",
    "torch.linear": "K.linear({args})",  # cuBLAS
    "torch.logits": "K.logits({0}, {1}, batch.logits_indices)",  # cuBLAS, fp32 out
})
# Every other cpu kernel runs on a GPU target as its torch implementation: `torch.X` calls K.X, which the
# triton library forwards to the cpu library (module __getattr__) unless it defines X itself.
EMITTERS.update({f"torch.{k[4:]}": v for k, v in list(EMITTERS.items())
                 if k.startswith("cpu.") and f"torch.{k[4:]}" not in EMITTERS})

# Ops that are plumbing, not kernels: model.py spells them as Python (attribute reads, slicing, unpacking).
STRUCTURAL_OPS = frozenset({"input", "param", "block", "getitem", "view", "slice"})
