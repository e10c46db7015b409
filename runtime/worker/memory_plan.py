"""The KV pool's memory plan: how many KV blocks a load gets, from an explicit size, the manifest, a byte
budget, or (on CUDA) vLLM's profile run: the device's memory less the weights, a dummy prefill's activation
peak and the decode graphs' reserve."""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import KVCacheConfig
from ..core.batch import cdiv
from ..errors import ArtifactError
from ..forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 * 2**20


def plan_kv_cache(*, bytes_per_block: int, total: int, fraction: float, weights: int, activation_peak: int,
                  graph_reserve: int, free: int | None = None, proposer_per_block: int = 0,
                  proposer_fixed: int = 0) -> dict[str, Any]:
    """The KV pool of a CUDA load, vLLM's profile-run arithmetic: `fraction` of the device's `total` memory, less
    the weights (allocated after load), the activation peak of the largest step (measured by a dummy
    max_batched_tokens prefill) and the decode graphs' reserve (captured after the pool is allocated). `free`
    (device memory free now, other processes' use included) caps it, so a shared device cannot over-commit.
    A speculative proposer loaded after the plan (speculative.PoolShare) takes `proposer_fixed` bytes and
    `proposer_per_block` beside each block. Raises ArtifactError, naming each part, when not one block fits."""
    budget = int(fraction * total) - weights - activation_peak - graph_reserve - proposer_fixed
    room = budget if free is None else min(budget, free - activation_peak - graph_reserve - proposer_fixed)
    blocks = max(room, 0) // (bytes_per_block + proposer_per_block)
    if blocks <= 0:
        capped = "" if free is None or room == budget else f"; only {_gib(free)} of the device is free"
        raise ArtifactError(
            f"no memory left for the KV cache: {fraction:g} x {_gib(total)} device memory - {_gib(weights)} weights "
            f"- {_gib(activation_peak)} activation peak - {_gib(graph_reserve)} CUDA-graph reserve leaves "
            f"{_gib(room)}" + (f" after the speculative proposer's {_gib(proposer_fixed)}" if proposer_fixed else "")
            + f", less than one KV block of {bytes_per_block + proposer_per_block} bytes{capped}; lower "
            "max_num_batched_tokens, raise kv_cache.memory_fraction, or pass num_kv_blocks / kv_cache_bytes")
    return {"source": "profiled", "total": total, "fraction": fraction, "weights": weights,
            "activation_peak": activation_peak, "graph_reserve": graph_reserve, "free": free,
            "kv_bytes": blocks * bytes_per_block, "kv_blocks": int(blocks),
            "proposer_bytes": blocks * proposer_per_block + proposer_fixed}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def profile_lengths(max_batched_tokens: int, chunk: int | None, max_model_len: int, max_seqs: int) -> list[int]:
    """The prompt lengths of the largest prefill step the scheduler can build: `max_batched_tokens` tokens cut
    into chunks of `chunk` (chunked prefill; else max_model_len) tokens, at most `max_seqs` sequences."""
    size = max(1, min(chunk or max_model_len, max_model_len, max_batched_tokens))
    full, rest = divmod(max_batched_tokens, size)
    return ([size] * full + ([rest] if rest else []))[:max_seqs]


def profile_batch(lengths: list[int], block_size: int, device: torch.device, vocab_size: int = 1) -> ForwardBatch:
    """A prefill ForwardBatch of fresh sequences of `lengths` tokens, each in its own consecutive blocks of a cache
    of sum(ceil(length / block_size)) blocks; one logits row per sequence, like sampling. Token k is
    (k * 7919) % vocab_size: varied ids, so an MoE model routes the profile's tokens over many experts (as real
    text does) rather than all to the same few, which would understate the fused-MoE kernels' buffers."""
    bs = block_size
    widths = [cdiv(n, bs) for n in lengths]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    tables = [[s + j for j in range(w)] + [-1] * (max(widths) - w) for s, w in zip(starts, widths)]
    slots = [(s + p // bs) * bs + p % bs for s, n in zip(starts, lengths) for p in range(n)]
    qsl = [sum(lengths[:i]) for i in range(len(lengths) + 1)]

    def i32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return ForwardBatch(input_ids=i32([k * 7919 % vocab_size for k in range(qsl[-1])]), positions=i32([p for n in lengths for p in range(n)]),
                        query_start_loc=i32(qsl), seq_lens=i32(lengths), block_tables=i32(tables),
                        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                        logits_indices=i32([q - 1 for q in qsl[1:]]), num_decodes=0)


@torch.inference_mode()
def profile_activation_peak(model: Any, kv: KVCacheConfig, device: torch.device, lengths: list[int],
                            vocab_size: int = 1) -> int:
    """Device memory one forward of the prefill `lengths` takes beyond its inputs and a KV cache just big enough
    for it: torch.cuda.max_memory_allocated over the step, less what was allocated before it. The temporary
    cache is freed (and returned to the device) before the real pool is sized."""
    fb = profile_batch(lengths, kv.block_size, device, vocab_size)
    caches = [torch.zeros((fb.block_tables.shape[0] * fb.block_tables.shape[1], *kv.shape), dtype=kv.dtype,
                          device=device) for _ in range(kv.num_layers)]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = model.forward(fb, caches)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits, caches, fb
    torch.cuda.empty_cache()
    return int(peak)


def plan_memory(kv: KVCacheConfig, device: torch.device, *, num_kv_blocks: int | None = None,
                kv_cache_bytes: int | None = None, memory_fraction: float = 0.9, model: Any = None,
                prefill_lengths: list[int] | None = None, graph_reserve: int = 0,
                vocab_size: int = 1, proposer: Any = None) -> dict[str, Any]:
    """The KV pool's size and how it was reached (`kv_blocks`, `kv_bytes`, `source`). An explicit block count
    wins; then a byte budget; then the manifest's decision (`kiln compile --report` predicts from the same):
    its `num_blocks`, else its `pool_bytes` (the cpu target's budget). Else, on CUDA, the pool is what
    `plan_kv_cache` leaves after the weights, the activation peak of a dummy prefill of `prefill_lengths`
    through `model` (no model: not profiled, 0) and `graph_reserve`; off CUDA (a GPU artifact under the
    Triton interpreter) DEFAULT_CPU_KV_BYTES. A byte budget or a profiled device is shared with a speculative
    `proposer`'s memory (a speculative.PoolShare: its own pool, sized per target block, and its weights), so the
    two fit together; a block count (explicit or the manifest's) is the target's alone."""
    per_block, fixed = (proposer.per_block, proposer.fixed) if proposer is not None else (0, 0)
    shared = False  # the proposer takes part of the budget (a block count is the target's alone)
    if num_kv_blocks is not None:
        source, n = "num_kv_blocks", num_kv_blocks
    elif kv.num_blocks is not None and kv_cache_bytes is None:
        source, n = "manifest", kv.num_blocks
    elif kv_cache_bytes is not None or kv.pool_bytes is not None or device.type != "cuda":
        source, budget = (("kv_cache_bytes", kv_cache_bytes) if kv_cache_bytes is not None else
                          ("manifest pool_bytes", kv.pool_bytes) if kv.pool_bytes is not None else
                          ("interpreter default", DEFAULT_CPU_KV_BYTES))
        n = max(budget - fixed, 0) // (kv.bytes_per_block + per_block)
        shared = bool(per_block or fixed)
    else:
        torch.cuda.empty_cache()  # memory the caching allocator holds but no tensor uses is free for KV
        weights = torch.cuda.memory_allocated(device)
        peak = (profile_activation_peak(model, kv, device, prefill_lengths, vocab_size)
                if model is not None and prefill_lengths else 0)
        free, total = torch.cuda.mem_get_info(device)
        return plan_kv_cache(bytes_per_block=kv.bytes_per_block, total=total, fraction=memory_fraction,
                             weights=weights, activation_peak=peak, graph_reserve=graph_reserve, free=free,
                             proposer_per_block=per_block, proposer_fixed=fixed)
    if n <= 0:
        raise ArtifactError(f"no memory left for the KV cache ({n} blocks of {kv.bytes_per_block} bytes fit); "
                            "lower the weights' footprint, raise kv_cache.memory_fraction or pass num_kv_blocks")
    plan = {"source": source, "kv_blocks": int(n), "kv_bytes": int(n) * kv.bytes_per_block}
    if shared:
        plan["proposer_bytes"] = int(n) * per_block + fixed
    return plan


def resolve_num_blocks(kv: KVCacheConfig, device: torch.device, *, num_kv_blocks: int | None = None,
                       kv_cache_bytes: int | None = None, memory_fraction: float = 0.9) -> int:
    """`plan_memory`'s block count, without profiling (benchmarks size a pool from a byte budget this way)."""
    return plan_memory(kv, device, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                       memory_fraction=memory_fraction)["kv_blocks"]


def describe_memory_plan(plan: dict[str, Any], block_size: int) -> str:
    """One log line: the pool, and on a profiled load the parts it was cut from."""
    head = f"KV cache: {plan['kv_blocks']} blocks ({plan['kv_blocks'] * block_size:,} tokens, {_gib(plan['kv_bytes'])})"
    proposer = f" (beside the speculative proposer's {_gib(plan['proposer_bytes'])})" if plan.get("proposer_bytes") else ""
    if plan["source"] != "profiled":
        return f"{head} from {plan['source']}{proposer}"
    return (f"{head} = {plan['fraction']:g} x {_gib(plan['total'])} - weights {_gib(plan['weights'])} "
            f"- activation peak {_gib(plan['activation_peak'])} - CUDA-graph reserve {_gib(plan['graph_reserve'])}"
            + (f" - speculative proposer {_gib(plan['proposer_bytes'])}" if plan.get("proposer_bytes") else ""))


def plan_engine_pool(artifact: Any, sched: Any, graphs: Any, *, num_kv_blocks: int | None = None,
                     kv_cache_bytes: int | None = None, proposer: Any = None) -> dict[str, Any]:
    """`plan_memory` for an engine over a loaded artifact with scheduler config `sched`: profiled (on CUDA) with
    the scheduler's largest prefill, reserving the manifest's CUDA-graph estimate when `graphs` are captured."""
    kv, manifest, cfg = artifact.kv_cache_config, artifact.manifest, artifact.model_config
    plan = plan_memory(
        kv, artifact.device, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
        memory_fraction=float(manifest["kv_cache"].get("memory_fraction", 0.9)), model=artifact.model,
        prefill_lengths=profile_lengths(sched.max_batched_tokens, sched.chunked_prefill, cfg.max_model_len,
                                        sched.max_seqs),
        graph_reserve=int((manifest.get("cuda_graphs") or {}).get("estimated_bytes", 0)) if graphs else 0,
        vocab_size=cfg.vocab_size, proposer=proposer)
    logger.info(describe_memory_plan(plan, kv.block_size))
    return plan
