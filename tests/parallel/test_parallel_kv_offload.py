"""The CPU offload tier on a tensor-parallel mesh (runtime/worker/distributed/kv_offload.py): every rank offloads and
restores its own slice of the same blocks, the copies sent as KV_OFFLOAD commands in lockstep with rank 0's
scheduler, and a restore commits only when every rank's slices check out.

Greedy fp32 on a tiny random HF llama (GQA 4:2, so each of the two ranks holds one KV head), a device pool of 12
blocks per rank and a workload that evicts a session's prefix and then returns to it (tests/runtime/
test_kv_offload.py's): the tp = 2 run with the tier gives the single-device artifact's tokens and logprobs, and a
tp = 2 run's without it, and its returning request is served from restored blocks, not recomputed. The mesh runs as
rank worker processes over gloo (one torch thread each), or as the single-process mesh where a test reaches into a
rank's host slots. Every engine is shut down in `finally`.
"""
from __future__ import annotations

import random

import pytest
import torch
from kiln.runtime.block_hash import block_hashes
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.errors import ArtifactError
from kiln.runtime.sampling_params import SamplingParams

NEW = 6
POOL = 12  # device blocks (on every rank)
OFFLOAD_BYTES = 4 << 20  # the tier: hundreds of this model's blocks
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def arts(compile_parallel):
    _, single = compile_parallel("llama", None)
    _, tp2 = compile_parallel("llama", "tp = 2")
    return single, tp2


def _serve(engine: EngineCore, requests) -> dict[str, tuple[list[int], list[float], int]]:
    """Each request alone, in order: (tokens, their logprobs, prompt tokens served by the cache); the pool's and the
    tier's accounting checked after every step."""
    out = {}
    for rid, prompt in requests:
        engine.add_request(rid, prompt, PARAMS)
        seq = engine.requests[rid].seqs[0]
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for d in engine.step():
                assert d.error is None, d.error
                tokens += d.token_ids
                logprobs += [entry[1][0] for entry in d.logprobs or []]
            engine.block_manager.check_invariants(engine.scheduler.running)
            if engine.offload is not None:
                engine.offload.check()
        out[rid] = (tokens, logprobs, seq.num_cached_tokens)
    return out


def _first_sessions(engine: EngineCore) -> list[tuple[str, list[int]]]:
    rng, bs = random.Random(3), engine.block_manager.block_size
    return [(f"s{i}", [rng.randrange(5, engine.limits.vocab_size) for _ in range(4 * bs + 3)]) for i in range(4)]


def _returning(first, out) -> list[int]:
    """The first session returns: its prompt and answer, then a new turn (the other sessions evicted its blocks)."""
    return first[0][1] + out["s0"][0] + [7, 8, 9]


def _workload(engine: EngineCore, before_return=None) -> dict[str, tuple[list[int], list[float], int]]:
    first = _first_sessions(engine)
    out = _serve(engine, first)
    returning = _returning(first, out)
    if before_return is not None:
        before_return(engine, returning)
    out.update(_serve(engine, [("back", returning)]))
    return out


def _run(art, executor: str | None, offload_bytes: int, before_return=None):
    engine = EngineCore(art, num_kv_blocks=POOL, kv_offload_bytes=offload_bytes, executor=executor)
    try:
        out = _workload(engine, before_return)
        counts = dict(engine.offload.counts) if engine.offload is not None else None
        return out, counts, engine.stats(), engine
    finally:
        engine.runner.shutdown()


def _assert_same(got, want, atol: float) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=atol, rtol=0)


def test_tp2_restores_every_ranks_slice_with_the_single_device_outputs(arts):
    single, tp2 = arts
    reference, _, _, _ = _run(single, None, 0)
    plain, _, _, _ = _run(tp2, "mp", 0)
    tiered, counts, stats, engine = _run(tp2, "mp", OFFLOAD_BYTES)
    bs = engine.block_manager.block_size
    _assert_same(tiered, reference, atol=1e-4)  # the mesh against one device: reductions split over the ranks
    _assert_same(tiered, plain, atol=1e-5)  # restored KV is the KV the mesh computed
    assert plain["back"][2] == 0, "the workload was meant to evict the first session's prefix"
    assert tiered["back"][2] >= 4 * bs  # the first prompt's full blocks, restored: fewer prompt tokens computed
    assert counts["restored"] * bs == tiered["back"][2] and counts["offloaded"] >= 4 and counts["failed"] == 0
    assert stats["kv_offload_restored"] == counts["restored"] and stats["kv_blocks_offloaded"] > 0
    # the tier's bytes are both ranks' slices of a block (one KV head of two each)
    assert engine.offload.block_bytes == 2 * engine.offload.store.block_bytes
    assert stats["kv_offload_restore_bytes"] == counts["restored"] * engine.offload.block_bytes
    assert engine.offload.num_blocks == OFFLOAD_BYTES // engine.offload.block_bytes


def _corrupt_rank1_first_block(engine: EngineCore, returning: list[int]) -> None:
    """Rank 1's host copy of the returning prefix's first block changes after it was offloaded (its digest taken)."""
    assert not engine.runner._offload_saves, "every save reached the ranks"
    h = block_hashes(returning, engine.block_manager.block_size, [])[0]
    slot = engine.offload._slot_of[h]
    rank1 = engine.runner.states[1].host_kv
    rank1.saved_digest(slot)
    rank1.host[0][slot] += 1.0
    engine.corrupted = h  # (read back by the test)


def test_a_rank_slice_that_changed_fails_the_restore_and_the_blocks_are_recomputed(arts):
    """Single-process mesh (the test reaches rank 1's host slots): one rank's slice of one block differs from what
    it offloaded, rank 0's is intact. The restore's lease is not committed, its blocks go back to the pool, the
    returning prompt is computed again and its tokens are still the single-device artifact's; the failed host
    copies are dropped, so the recomputed blocks are offloaded afresh when evicted."""
    single, tp2 = arts
    reference, _, _, _ = _run(single, None, 0)
    out, counts, stats, engine = _run(tp2, "local", OFFLOAD_BYTES, _corrupt_rank1_first_block)
    _assert_same(out, reference, atol=1e-4)
    assert counts["failed"] == 1 and counts["restored"] == 0 and out["back"][2] == 0
    assert engine.offload.ledger.counts["failed"] == 1 and engine.offload.ledger.counts["succeeded"] == 0
    slot = engine.offload._slot_of.get(engine.corrupted)  # dropped, or offloaded afresh once recomputed
    rank1 = engine.runner.states[1].host_kv
    assert slot is None or rank1._content_digest(slot) == rank1.saved_digest(slot)
    engine.offload.check()


def test_without_a_mismatch_the_single_process_mesh_restores_too(arts):
    _, tp2 = arts
    plain, _, _, _ = _run(tp2, "local", 0)
    out, counts, _, engine = _run(tp2, "local", OFFLOAD_BYTES)
    _assert_same(out, plain, atol=1e-5)
    assert counts["restored"] * engine.block_manager.block_size == out["back"][2] > 0 and counts["failed"] == 0


def test_data_parallel_attention_is_refused_at_load(compile_parallel):
    """The compiler refuses `kv_cache { offload }` with dp > 1 at its recipe line (tests/compiler/test_targets.py);
    a dp artifact served with --kv-offload is refused when the engine starts, and its mesh is stopped."""
    _, dp2 = compile_parallel("llama", "dp = 2; dense = replicated")
    with pytest.raises(ArtifactError, match=r"data-parallel attention \(parallel.dp > 1\) is not implemented"):
        EngineCore(dp2, num_kv_blocks=POOL, kv_offload_bytes=OFFLOAD_BYTES, executor="local")


RECIPE = """
recipe r {
  model    = llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)
  weights  = random(seed=1)
  target   = cpu
  parallel { tp = 2 }
  kv_cache { offload = cpu(1MiB) }
}
"""


def test_a_tp_recipe_with_offload_compiles_and_splits_the_tier_over_the_ranks(tmp_path):
    """`kv_cache { offload = cpu(SIZE) }` with `parallel { tp = 2 }` compiles (refused before the mesh tier existed);
    SIZE is the tier's host memory over both ranks: each holds that many slots of its slice of a block."""
    import kiln

    p = tmp_path / "r.dsl"
    p.write_text(RECIPE)
    art = kiln.compile(p, tmp_path / "art", progress=False)
    assert art.manifest["kv_cache"]["offload_bytes"] == 2**20 and art.manifest["parallel"]["world_size"] == 2
    engine = EngineCore(tmp_path / "art", num_kv_blocks=8, executor="local")
    try:
        tier = engine.offload
        slice_bytes = engine.artifact.kv_cache_config.bytes_per_block
        assert tier.store.block_bytes == slice_bytes and tier.block_bytes == 2 * slice_bytes
        assert tier.num_blocks == 2**20 // (2 * slice_bytes)
        assert all(s.host_kv.host[0].shape[0] == tier.num_blocks for s in engine.runner.states)
    finally:
        engine.runner.shutdown()


def test_a_rank_that_cannot_allocate_the_tier_fails_the_start_with_its_count(arts, monkeypatch):
    """Every rank allocates its host slots in one command whose failures are summed over the mesh: one rank out of
    host memory refuses the tier at load (the mesh is stopped), not at the first restore's collective."""
    import threading

    from kiln.runtime.worker.distributed import kv_offload

    class NoRoomOnOtherRanks(kv_offload.HostKV):
        def __init__(self, kv_caches, num_blocks):
            if threading.current_thread().name.startswith("kiln-rank"):  # the single-process mesh's ranks > 0
                raise MemoryError("no host memory here")
            super().__init__(kv_caches, num_blocks)

    monkeypatch.setattr(kv_offload, "HostKV", NoRoomOnOtherRanks)
    _, tp2 = arts
    with pytest.raises(ArtifactError, match="1 of the 2 ranks could not allocate"):
        EngineCore(tp2, num_kv_blocks=POOL, kv_offload_bytes=OFFLOAD_BYTES, executor="local")
