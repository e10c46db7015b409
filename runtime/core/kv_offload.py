"""The CPU offload tier under the prefix cache (`kv_cache { offload = cpu(SIZE) }`, `kiln serve --kv-offload`).

A prefix-cache block the device pool evicts is copied into a host-memory pool (pinned where CUDA is present) and
keyed by its block hash; a later lookup that runs past the device cache's hits continues in the tier, and the
blocks found there are copied back into fresh device blocks instead of being recomputed. The tier evicts by LRU.

Restores go through the same machinery as a disaggregated transfer's writes (core/lease.py): the destination
blocks are *leased* from the block manager (ref count 1, held by the ledger: no allocator hands them out), each
copy is a `begin_write` / `end_write` with the digest of what was copied, and the blocks pass to the prefix cache
only when `commit` finds every digest equal to the one recorded when the block was offloaded. A restore aborted
while a copy is in flight is released late, when the copy ended, so no block is ever both free and written.
Host slots being read by a restore are pinned: the tier's LRU never reuses them meanwhile.

The digest of an offloaded block is computed by a thread of the tier's own, off the step: an eviction happens while
the scheduler allocates, and BLAKE2b over a block costs ~8-14 copies of it (docs/performance.md, "CPU offload tier").
hashlib releases the GIL for buffers this large. A restore waits for the digests of its slots; a slot is reused only
once its pending digest was computed or cancelled, so the thread always reads what was offloaded.

On a tensor-parallel mesh this bookkeeping is rank 0's and every rank holds the same host slots, each its slice of
a block; the copies are commands the ranks run in lockstep and a restore commits only when every rank's slices
check out (worker/distributed/kv_offload.py). A failed restore drops its host copies: the blocks are recomputed.

Accounting: device free + active + leased + cached == total (the ledger's `check`); host
free + offloaded == capacity (`check`), `offloaded` counting the slots that hold a block (some of them being read).
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import torch

from ..worker.host_kv import HostKV
from ..worker.interface import ExecutorError
from .kv_cache import BlockManager
from .lease import Lease, TransferLedger

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Restore:
    """A restore in progress: the lease on the destination blocks, the host slots read, their hashes."""
    lease: Lease
    slots: list[int]
    hashes: list[bytes]
    reading: bool = True  # its host slots are pinned


class OffloadTier:
    """`num_blocks` host blocks under `bm`'s prefix cache, for the device pool `kv_caches` (one tensor per layer,
    [num_device_blocks, *block shape]). Attaching it hooks the prefix cache's evictions and the block manager's
    lookups (`bm.offload`). Driven by the engine's loop, like the block manager; only the offload digests run on a
    thread of the tier's (its `store`, a HostKV). A mesh's tier is `MeshOffloadTier` below:
    the same bookkeeping, the copies run by every rank."""

    def __init__(self, bm: BlockManager, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.store = HostKV(kv_caches, num_blocks)
        self._attach(bm, num_blocks, self.store.block_bytes)

    def _attach(self, bm: BlockManager, num_blocks: int, block_bytes: int) -> None:
        assert bm.prefix_cache is not None, "the offload tier lives under a prefix cache"
        assert num_blocks > 0, f"bad offload tier: {num_blocks} blocks"
        self.bm = bm
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        if bm.ledger is None:  # else the pool's (a decode core's transfers, disagg/roles.py): one over the pool
            TransferLedger(bm)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # block hash -> host slot, least recently used first
        self._hash_of: dict[int, bytes] = {}  # host slot -> block hash
        self._free: deque[int] = deque(range(num_blocks))
        self._reading: Counter[int] = Counter()  # host slots restores are copying from (never reused meanwhile)
        self._ids = itertools.count()
        self.counts = Counter(offloaded=0, restored=0, offload_bytes=0, restore_bytes=0, dropped=0, failed=0)
        bm.offload = self
        bm.prefix_cache.on_evict = self.offload

    @property
    def ledger(self) -> TransferLedger:
        return self.bm.ledger

    @property
    def num_offloaded(self) -> int:
        return len(self._hash_of)

    # Device -> host ---------------------------------------------------------------------------------------
    def offload(self, block_hash: bytes, block_id: int) -> None:
        """The prefix cache evicts `block_id` (content `block_hash`): keep a copy, before anyone rewrites it."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:  # restored from here earlier and unchanged since: nothing to copy
            self._slot_of.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:  # every slot is being read by a restore
            self.counts["dropped"] += 1
            return
        self._save(slot, block_id)
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self.counts["offloaded"] += 1
        self.counts["offload_bytes"] += self.block_bytes

    def _save(self, slot: int, block_id: int) -> None:
        self.store.save(slot, block_id)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for block_hash, slot in self._slot_of.items():  # the least recently used slot nobody is reading
            if not self._reading[slot]:
                del self._slot_of[block_hash], self._hash_of[slot]
                return slot  # its store's save waits for the slot's pending digest
        return None

    # Host -> device ---------------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> int:
        """How many of `hashes` (continuing a device hit) the tier holds, in a row from the first, up to one the
        device pool holds itself."""
        n, device = 0, self.bm.prefix_cache
        for h in hashes:
            if h not in self._slot_of or device.holds(h):
                break
            n += 1
        return n

    def restore(self, hashes: list[bytes], hits: list[int]) -> list[int]:
        """Copies the blocks of the longest prefix of `hashes` the tier holds into fresh device blocks and
        publishes them to the prefix cache (unreferenced, like any cached block); `hits` (the device hits in front
        of them) are kept from eviction meanwhile. Returns the restored block ids (maybe fewer, or none, when the
        pool cannot spare the blocks or a copy did not check out)."""
        pending = self.start(hashes, hits)
        if pending is None:
            return []
        for i in range(len(pending.slots)):
            self.copy(pending, i)
        return self.finish(pending)

    def start(self, hashes: list[bytes], hits: list[int]) -> Restore | None:
        """Leases the destination blocks and admits one write into each (the copies are `copy`'s)."""
        bm = self.bm
        pinned = sum(1 for b in hits if bm.ref_counts[b] == 0)
        n = min(self.lookup(hashes), bm.num_available_blocks - pinned)
        if n <= 0:
            return None
        hashes = list(hashes[:n])
        slots = [self._slot_of[h] for h in hashes]
        self._reading.update(slots)  # before the lease: taking blocks evicts, and an eviction offloads
        lease = self.ledger.reserve(f"offload:{next(self._ids)}", n, hits)
        assert lease is not None, "num_available_blocks said the pool could spare them"
        for i, (b, gen) in enumerate(zip(lease.blocks, lease.generations, strict=True)):
            assert self.ledger.begin_write(lease.transfer_id, i, b, gen)
        self._expect(lease, slots)
        for h in hashes:
            self._slot_of.move_to_end(h)
        return Restore(lease, slots, hashes)

    def _expect(self, lease: Lease, slots: list[int]) -> None:
        """The digests the restore's blocks must arrive with: those of the slots' content when offloaded."""
        self.ledger.expect(lease.transfer_id, [self.store.saved_digest(s) for s in slots])

    def copy(self, pending: Restore, index: int) -> None:
        """Copies block `index` of the restore host -> device and ends its write with the digest of what the host
        slot holds now."""
        slot, block = pending.slots[index], pending.lease.blocks[index]
        digest = None
        try:
            digest = self.store.load(slot, block)
        finally:
            self.ledger.end_write(pending.lease.transfer_id, index, digest)

    def abort(self, pending: Restore) -> None:
        """Ends the restore (idempotent); its blocks return to the pool once no copy into them is in flight."""
        self.ledger.abort(pending.lease.transfer_id)
        self._done_reading(pending)

    def finish(self, pending: Restore) -> list[int]:
        """Commits the restore: its blocks join the prefix cache, unreferenced. [] when it did not check out."""
        lease = self.ledger.commit(pending.lease.transfer_id)
        self._done_reading(pending)
        if lease is None:
            self.counts["failed"] += 1
            self.ledger.abort(pending.lease.transfer_id)
            self._forget(pending.hashes)
            return []
        bm = self.bm
        n = 0  # published: up to a block whose content the device pool came to hold meanwhile (the rest are freed)
        while n < len(lease.blocks) and bm.prefix_cache.insert(pending.hashes[n], lease.blocks[n]):
            n += 1
        bm.unpin(reversed(lease.hit_blocks + lease.blocks))  # the published ones stay cached, evictable
        self.counts["restored"] += n
        self.counts["restore_bytes"] += n * self.block_bytes
        return list(lease.blocks[:n])

    def _forget(self, hashes: list[bytes]) -> None:
        """Drops the host copies of a restore that did not check out: the blocks are recomputed, and offloaded afresh
        when evicted again (`offload` skips the copy of a hash the tier still holds)."""
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is not None and not self._reading[slot]:  # (one another restore reads stays: it fails there)
                del self._slot_of[h], self._hash_of[slot]
                self._free.append(slot)

    def _done_reading(self, pending: Restore) -> None:
        if pending.reading:
            pending.reading = False
            self._reading.subtract(pending.slots)
            self._reading += Counter()  # drops the zeros

    # Accounting -------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {**self.counts, "blocks": self.num_offloaded, "capacity": self.num_blocks}

    def check(self) -> None:
        """Host free + offloaded == capacity; slots and hashes map one to one; the device pool's accounting."""
        assert len(self._free) + len(self._hash_of) == self.num_blocks, \
            f"host slots leaked: {len(self._free)} free + {len(self._hash_of)} offloaded != {self.num_blocks}"
        assert len(set(self._free)) == len(self._free), "a host slot is free twice"
        assert not set(self._free) & set(self._hash_of), "a free host slot holds a block"
        assert {s: h for h, s in self._slot_of.items()} == self._hash_of, "host slots and hashes disagree"
        assert all(self._reading[s] == 0 or s in self._hash_of for s in self._reading), "a restore reads a free slot"
        self.ledger.check()


class MeshOffloadTier(OffloadTier):
    """Rank 0's offload tier over a tensor-parallel `executor` (a distributed.executor.MeshExecutor): the single-device
    tier's bookkeeping and ledger invariants, the copies sent to every rank (saves queued on the executor until its
    next command, loads run at once). `num_blocks` host slots on every rank; `block_bytes` the whole block, every
    rank's slice together."""

    def __init__(self, bm: BlockManager, executor: Any, num_blocks: int) -> None:
        self.executor = executor
        executor.attach_offload(num_blocks)  # every rank's HostKV
        self.store = executor.states[0].host_kv  # rank 0's slices (what `host` shows)
        self._attach(bm, num_blocks, self.store.block_bytes * executor.world_size)

    def _save(self, slot: int, block_id: int) -> None:
        self.executor.queue_offload_save(block_id, slot)

    def _expect(self, lease, slots: list[int]) -> None:
        pass  # the digests as saved are every rank's: they come back with the copies (`restore`)

    def restore(self, hashes: list[bytes], hits: list[int]) -> list[int]:
        pending = self.start(hashes, hits)
        if pending is None:
            return []
        tid = pending.lease.transfer_id
        try:
            results = self.executor.offload_restore(pending.slots, pending.lease.blocks)
        except ExecutorError as e:  # the mesh failed: the next step fails the requests; nothing restored here
            logger.error("KV offload restore not run: %s", e)
            results = [(b"", None)] * len(pending.slots)
        self.ledger.expect(tid, [saved for saved, _ in results])
        for i, (_, copied) in enumerate(results):
            self.ledger.end_write(tid, i, copied)
        return self.finish(pending)

    def copy(self, pending, index: int) -> None:  # pragma: no cover - the mesh copies a restore's blocks together
        raise NotImplementedError("a mesh restore's copies are one command on every rank (MeshOffloadTier.restore)")


def attach_offload(engine, num_bytes: int | None) -> OffloadTier | None:
    """The engine's tier of `num_bytes` of host memory (None or 0: none), for the KV pool in this process or, on a
    tensor-parallel mesh, split evenly over the ranks (each holds its slice of every host block). Needs a prefix
    cache."""
    if not num_bytes:
        return None
    from ..errors import ArtifactError
    bm, runner = engine.block_manager, engine.runner
    if bm.prefix_cache is None:
        raise ArtifactError("kv_cache.offload needs the prefix cache (scheduler.prefix_cache = radix)")
    world = getattr(runner, "world_size", 1)
    if world > 1 and runner.data_parallel:
        raise ArtifactError(DATA_PARALLEL_REFUSAL)
    per_block = engine.artifact.kv_cache_config.bytes_per_block * world  # a rank's slice of a block, every rank
    num_blocks = num_bytes // per_block
    if num_blocks < 1:
        raise ArtifactError(f"kv_cache.offload: {num_bytes} bytes hold no KV block ({per_block} bytes each"
                            f"{f', over {world} ranks' if world > 1 else ''})")
    if world > 1:
        return MeshOffloadTier(bm, runner, num_blocks)
    return OffloadTier(bm, runner.kv_caches, num_blocks)


DATA_PARALLEL_REFUSAL = (
    "kv_cache.offload with data-parallel attention (parallel.dp > 1) is not implemented: each block's KV is on the "
    "one rank running its sequence, so a restore would have to move it to the rank the returning sequence is placed "
    "on (tensor-parallel meshes are served: every rank offloads its slice of the same blocks)")
