"""The CPU offload tier (runtime/core/kv_offload.py): evicted prefix-cache blocks go to host memory and come back on a
prefix hit instead of being recomputed, through the transfer path's leases and digests (core/lease.py).

Identity: greedy fp32 on a tiny random HF llama, a workload that evicts a session's prefix and then returns to it:
every request's tokens equal with and without the tier, and the returning request's equal HF's; with the tier it
computes fewer prompt tokens (its prefix-cache hit, counted at admission), without it none of them is cached."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from kiln.runtime.api.metrics import ServerMetrics
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.kv_offload import OffloadTier
from kiln.runtime.core.lease import LeaseState
from kiln.runtime.core.prefix_cache import PrefixCache
from kiln.runtime.core.stats import KV_BLOCK_FIELDS
from kiln.runtime.errors import ArtifactError
from kiln.runtime.ipc.protocol import CoreStats
from kiln.runtime.sampling_params import SamplingParams

import kiln
from kiln.cli import main

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _serve(engine: EngineCore, requests: list[tuple[str, list[int]]]) -> dict[str, tuple[list[int], int]]:
    """Each request alone (concurrency 1), in order; (tokens, prompt tokens served by the cache) per request. The
    pool's accounting is checked after every step."""
    out = {}
    for rid, prompt in requests:
        engine.add_request(rid, prompt, GREEDY)
        seq = engine.requests[rid].seqs[0]
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for d in engine.step():
                tokens += d.token_ids
            engine.block_manager.check_invariants(engine.scheduler.running)
            if engine.offload is not None:
                engine.offload.check()
        out[rid] = (tokens, seq.num_cached_tokens)
    return out


def _workload(vocab: int, bs: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(5, vocab) for _ in range(4 * bs + 3)] for _ in range(4)]
    return [(f"s{i}", p) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def llama(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    return ckpt, art


def test_a_returning_prefix_comes_back_from_the_tier_with_the_same_tokens(llama, hf_reference):
    ckpt, art = llama
    runs = {}
    for offload in (True, False):
        probe = EngineCore(art, num_kv_blocks=12)
        bs, per_block = probe.block_manager.block_size, probe.artifact.kv_cache_config.bytes_per_block
        engine = EngineCore(art, num_kv_blocks=12, kv_offload_bytes=64 * per_block if offload else 0)
        first = _workload(engine.limits.vocab_size, bs)
        out = _serve(engine, first)
        # the first session returns: its prompt and answer, then a new turn; the other sessions evicted its blocks
        returning = first[0][1] + out["s0"][0] + [7, 8, 9]
        out.update(_serve(engine, [("back", returning)]))
        runs[offload] = (out, engine, returning, bs)
    (tier_out, tier_engine, returning, bs), (plain_out, plain_engine, _, _) = runs[True], runs[False]
    assert {r: t for r, (t, _) in tier_out.items()} == {r: t for r, (t, _) in plain_out.items()}
    assert tier_out["back"][0] == hf_reference(ckpt, returning, NEW)[1]
    assert plain_out["back"][1] == 0, "the workload was meant to evict the first session's prefix"
    assert tier_out["back"][1] >= 4 * bs  # the first prompt's full blocks, restored: fewer prompt tokens computed
    counts = tier_engine.offload.counts
    assert counts["restored"] * bs == tier_out["back"][1] and counts["offloaded"] >= 4 and counts["failed"] == 0
    stats = tier_engine.stats()
    assert stats["kv_offload_restored"] == counts["restored"]
    assert stats["kv_offload_restore_bytes"] == counts["restored"] * tier_engine.offload.block_bytes
    assert stats["kv_blocks_offloaded"] == tier_engine.offload.num_offloaded > 0
    assert sum(stats[f"kv_blocks_{s}"] for s in ("free", "active", "leased", "cached")) == 12
    assert plain_engine.offload is None and plain_engine.stats()["kv_blocks_offloaded"] == 0
    # /metrics: what the core reports (CoreStats) as the server renders it
    core = CoreStats(**{f: stats[f] for f in KV_BLOCK_FIELDS})
    text = ServerMetrics("m", lambda: core, bs).render().decode()
    assert f'kiln:kv_blocks{{model_name="m",state="offloaded"}} {float(tier_engine.offload.num_offloaded)}' in text
    assert f'kiln:kv_restore_blocks_total{{model_name="m"}} {float(counts["restored"])}' in text
    assert f'kiln:kv_offload_hits_total{{model_name="m"}} {float(tier_out["back"][1])}' in text
    assert f'kiln:kv_offload_blocks_total{{model_name="m"}} {float(counts["offloaded"])}' in text


def _pool(num_blocks: int = 4, host: int = 3):
    bm = BlockManager(num_blocks, 2, PrefixCache())
    kv = [torch.zeros((num_blocks, 2), dtype=torch.float32)]
    return bm, kv, OffloadTier(bm, kv, host)


def _offload(bm: BlockManager, kv, block_hash: int) -> None:
    """A block computed with content `block_hash`, published, released, then evicted (so offloaded) and freed."""
    b = bm._take_free_block()
    kv[0][b] = float(block_hash)
    bm.prefix_cache.insert(block_hash, b)
    bm.unpin([b])
    assert bm.prefix_cache.evict() == b
    kv[0][b] = -1.0  # its next owner writes into it
    bm._free.append(b)


def test_the_tier_evicts_by_lru_within_its_size():
    bm, kv, tier = _pool(host=2)
    for h in (1, 2, 3):
        _offload(bm, kv, h)
    assert set(tier._slot_of) == {2, 3} and tier.counts["offloaded"] == 3
    _offload(bm, kv, 2)  # offloaded again, unchanged: no copy, most recently used
    _offload(bm, kv, 4)
    assert set(tier._slot_of) == {2, 4} and tier.counts["offloaded"] == 4
    tier.check()


def test_a_restore_copies_back_what_was_offloaded():
    bm, kv, tier = _pool()
    _offload(bm, kv, 7)
    _offload(bm, kv, 8)
    blocks = tier.restore([7, 8, 9], [])  # 9 was never offloaded: the restore stops there
    assert len(blocks) == 2 and [kv[0][b, 0].item() for b in blocks] == [7.0, 8.0]
    assert [bm.prefix_cache.lookup([7, 8])] == [blocks] and all(bm.ref_counts[b] == 0 for b in blocks)
    assert tier.counts["restored"] == 2 and tier.counts["restore_bytes"] == 2 * tier.block_bytes
    tier.check()


def test_a_restore_aborted_mid_copy_frees_its_block_only_when_the_copy_ended():
    bm, kv, tier = _pool()
    _offload(bm, kv, 42)
    pending = tier.start([42], [])
    dest = pending.lease.blocks[0]
    tier.abort(pending)
    assert dest not in bm._free and tier.ledger.state(pending.lease.transfer_id) is LeaseState.ABORTED
    tier.check()
    tier.copy(pending, 0)  # the copy in flight ends: only now the block is free, and it was never published
    assert dest in bm._free and not bm.prefix_cache.holds(42)
    tier.check()
    assert tier.lookup([42]) == 1  # the host copy is still there for the next hit


def test_a_host_block_that_changed_is_not_restored():
    bm, kv, tier = _pool()
    _offload(bm, kv, 42)
    tier.store._digest[tier._slot_of[42]].result()  # (its digest, taken on the tier's thread)
    tier.store.host[0][tier._slot_of[42]] += 1.0  # the host copy is not what was offloaded
    assert tier.restore([42], []) == []
    assert tier.counts["failed"] == 1 and not bm.prefix_cache.holds(42) and len(bm._free) == bm.num_blocks
    assert tier.lookup([42]) == 0  # the bad copy is dropped: recomputed, the block is offloaded afresh
    tier.check()


def test_offload_digests_off_the_step_and_a_reused_slot_waits_for_its_digest(monkeypatch):
    """The eviction's caller does not hash the block: the tier's thread does, and an LRU reuse of the slot (its next
    block copied in) waits until that thread read what was offloaded."""
    bm, kv, tier = _pool(host=1)
    gate, read = threading.Event(), []
    digest = tier.store._content_digest

    def slow(slot: int) -> bytes:
        read.append((threading.current_thread().name, tier.store.host[0][slot, 0].item()))
        assert gate.wait(30)
        return digest(slot)

    monkeypatch.setattr(tier.store, "_content_digest", slow)
    _offload(bm, kv, 1)  # returns with its digest still being computed (the gate is closed)
    pending = tier.store._digest[tier._slot_of[1]]
    assert not pending.done()
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    try:
        _offload(bm, kv, 2)  # the one slot goes to block 2: only once block 1's digest was read
    finally:
        timer.join(30)
    assert gate.is_set() and pending.done() and tier._slot_of == {2: 0}
    assert read[0][0].startswith("kiln-offload-digest") and read[0][1] == 1.0
    assert tier.restore([2], []) != [] and tier.counts["failed"] == 0
    tier.check()


def test_offload_needs_a_prefix_cache_and_room_for_a_block(llama):
    _, art = llama
    with pytest.raises(ArtifactError, match="needs the prefix cache"):
        EngineCore(art, num_kv_blocks=12, prefix_cache=None, kv_offload_bytes=2**20)
    with pytest.raises(ArtifactError, match="hold no KV block"):
        EngineCore(art, num_kv_blocks=12, kv_offload_bytes=10)


RECIPE = """
recipe r {
  model   = llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)
  weights = random(seed=1)
  target  = cpu
EXTRA
}
"""


def test_the_recipe_option_reaches_the_engine(tmp_path):
    """`kv_cache { offload = cpu(SIZE) }` compiles (it was refused before the tier existed), the manifest carries
    it, and the engine builds a tier of that size; an artifact without it has no tier and no manifest key."""
    arts = {}
    for name, extra in (("on", "  kv_cache { offload = cpu(1MiB) }"), ("off", "")):
        p = tmp_path / f"{name}.dsl"
        p.write_text(RECIPE.replace("EXTRA", extra))
        arts[name] = kiln.compile(p, tmp_path / name, progress=False)
    assert arts["on"].manifest["kv_cache"]["offload_bytes"] == 2**20
    assert "offload_bytes" not in arts["off"].manifest["kv_cache"]
    on = EngineCore(tmp_path / "on", num_kv_blocks=8)
    assert on.offload.num_blocks == 2**20 // on.artifact.kv_cache_config.bytes_per_block
    assert EngineCore(tmp_path / "off", num_kv_blocks=8).offload is None
    assert EngineCore(tmp_path / "on", num_kv_blocks=8, kv_offload_bytes=0).offload is None  # --kv-offload 0


@pytest.mark.parametrize("text, value", [("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9),
                                         ("4096", 4096), ("0", 0), ("none", 0)])
def test_kv_offload_flag_sizes(text, value):
    from kiln.runtime.cli_args import byte_size
    assert byte_size(text) == value


def test_a_bad_kv_offload_flag_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), "--kv-offload", "lots"])
    assert e.value.code == 2
    assert "'lots' is not a byte size" in capsys.readouterr().err
