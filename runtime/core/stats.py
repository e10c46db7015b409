"""The engine core's counters, as `EngineCore.stats()` reports them (the API server's /metrics reads them)."""
from __future__ import annotations

from typing import Any

# SpeculativeDecoder.stats(): verify steps (of a sequence with drafts), drafts verified and accepted in them
NO_SPECULATION = {"spec_num_drafts": 0, "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
                  "spec_acceptance_rate": 0.0, "spec_mean_acceptance_length": 0.0}


def core_stats(engine: Any) -> dict[str, float]:
    """Counts are of sequences; prefix-cache queries and hits are cumulative, in KV blocks;
    cuda_graph_bytes is the device memory the decode graphs took when captured at load; spec_* count speculative
    decoding's verify steps and draft tokens (mean acceptance length: tokens a verify step gains)."""
    pc, sched, spec = engine.block_manager.prefix_cache, engine.scheduler, engine.speculator
    return {"num_running": len(sched.running), "num_waiting": len(sched.waiting) + len(sched.swapped),
            "kv_usage": engine.block_manager.usage, "kv_reserved_blocks": engine.block_manager.num_reserved,
            "num_preemptions": sched.num_preemptions,
            "num_swapped_out": sched.num_swapped_out,
            "prefix_cache_queries": pc.queries if pc else 0, "prefix_cache_hits": pc.hits if pc else 0,
            "prefix_cache_hit_rate": pc.hits / pc.queries if pc and pc.queries else 0.0,
            "cuda_graph_bytes": engine.runner.graph_runner.memory_bytes if engine.runner.graph_runner else 0,
            **(spec.stats() if spec else NO_SPECULATION),
            "num_nonfinite_logits": engine.num_nonfinite_logits, **engine.constraints.stats(),
            **kv_block_stats(engine.block_manager)}


KV_BLOCK_FIELDS = ("kv_blocks_free", "kv_blocks_active", "kv_blocks_leased", "kv_blocks_cached", "kv_blocks_offloaded",
                   "kv_offload_offloaded", "kv_offload_restored", "kv_offload_offload_bytes", "kv_offload_restore_bytes")


def kv_block_stats(bm: Any) -> dict[str, int]:
    """The KV pool's blocks by state (`kv_blocks_<state>`: free, active, leased, cached, offloaded) and the offload
    tier's cumulative counters (`kv_offload_<what>`: offloaded, restored blocks; their bytes)."""
    from .lease import block_states

    states = bm.ledger.block_states() if bm.ledger is not None else block_states(bm)
    out = {f"kv_blocks_{state}": n for state, n in states.items()}
    out.setdefault("kv_blocks_offloaded", 0)
    counts = bm.offload.counts if bm.offload is not None else {}
    for what in ("offloaded", "restored", "offload_bytes", "restore_bytes"):
        out[f"kv_offload_{what}"] = counts.get(what, 0)
    return out

