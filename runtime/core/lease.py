"""Decode-side block leases: the state machine that keeps a remote prefill's writes out of reused blocks.

A `Lease` owns destination blocks taken from the `BlockManager` (ref count 1, held by the ledger, not by a
sequence) plus pins on the prefix-cache hits in front of them. Every lease hands each of its blocks a fresh
*generation* (a per-block counter bumped whenever a block is leased and whenever its lease lets it go), so a
frame addressed to a block id by an older transfer carries a stale generation and is refused.

Writes are bracketed: `begin_write` admits one frame into one block (lease live, block belongs to it, generation
current) and marks the block in flight; `end_write` records the frame's digest. A lease that ends (abort,
expiry, failure) while a write is in flight is *released late*: its blocks return to the pool only when the
last in-flight write into them ended. So no block is ever both free and the target of a write in progress.
`commit` succeeds only when every block arrived with the digest the sender's `Done` lists; the blocks then
pass to the sequence (leased -> active). `abort` is idempotent before, during and after a transfer; ended
transfers leave a tombstone, so a late or duplicate frame or completion is recognised and ignored.

Accounting, checked by `check`: free + active + leased + cached == total, where leased = blocks owned by live
or late-released leases, active = other referenced blocks, cached = evictable prefix-cache blocks.
"""
from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache import BlockManager


class LeaseState(enum.Enum):
    RESERVED = "reserved"    # blocks held, frames admitted
    COMMITTED = "committed"  # every block arrived and checked out; the blocks belong to the sequence now
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"        # a frame contradicted the lease (conflicting digest) or the sender gave up

    @property
    def ended(self) -> bool:
        return self is not LeaseState.RESERVED


@dataclass(slots=True)
class Lease:
    transfer_id: str
    hit_blocks: list[int]       # prefix-cache hits in front of the leased range (pinned, not written)
    blocks: list[int]           # destination block ids, in sequence order
    generations: list[int]      # generation of each destination block at reservation
    deadline: float
    state: LeaseState = LeaseState.RESERVED
    digests: dict[int, bytes] = field(default_factory=dict)  # block index -> digest of the frame written
    expected: list[bytes] | None = None  # the sender's Done: one digest per block
    inflight: set[int] = field(default_factory=set)          # block indices with a write in progress
    released: bool = False      # blocks given back (or handed to the sequence on commit)

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.digests) == len(self.blocks)


class TransferLedger:
    """The decode core's leases over its block manager's pool. Single-threaded: the core's loop drives it."""

    def __init__(self, block_manager: BlockManager, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, tombstones: int = 4096) -> None:
        self.bm = block_manager
        block_manager.ledger = self  # the pool's one ledger: a transfer's leases and the offload tier's restores
        self.lease_s = lease_s
        self.clock = clock
        self.generation = [0] * block_manager.num_blocks
        self.leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()  # tombstones of finished transfers
        self._tombstones = tombstones
        self.counts = {"started": 0, "succeeded": 0, "failed": 0, "expired": 0, "aborted": 0}

    # Reservation ------------------------------------------------------------------------------------------
    def reserve(self, transfer_id: str, num_blocks: int, hit_blocks: list[int] = ()) -> Lease | None:
        """Leases `num_blocks` fresh blocks behind the prefix hits `hit_blocks` (which it pins). None, changing
        nothing, when the pool cannot spare them. A transfer id is used once."""
        assert transfer_id not in self.leases and transfer_id not in self._ended, f"transfer {transfer_id} reused"
        hit_blocks = list(hit_blocks)
        bm = self.bm
        pinned = sum(1 for b in hit_blocks if bm.ref_counts[b] == 0)
        if num_blocks > bm.num_available_blocks - pinned:  # never into blocks promised to reservations
            return None
        bm.pin(hit_blocks)
        blocks = [bm._take_free_block() for _ in range(num_blocks)]
        for b in blocks:
            self.generation[b] += 1
        lease = Lease(transfer_id, hit_blocks, blocks, [self.generation[b] for b in blocks],
                      self.clock() + self.lease_s)
        self.leases[transfer_id] = lease
        self.counts["started"] += 1
        return lease

    # Writes -----------------------------------------------------------------------------------------------
    def begin_write(self, transfer_id: str, index: int, block_id: int, generation: int) -> bool:
        """Admits a frame for block `index` of the transfer: False (write nothing) unless the lease is live and
        unexpired, the block is its `index`-th, its generation is current and it is not being written now."""
        lease = self.leases.get(transfer_id)
        if lease is None or lease.state.ended or self.clock() > lease.deadline:
            return False
        if not 0 <= index < len(lease.blocks) or lease.blocks[index] != block_id:
            return False
        if self.generation[block_id] != generation or index in lease.inflight:
            return False
        lease.inflight.add(index)
        return True

    def end_write(self, transfer_id: str, index: int, digest: bytes | None) -> None:
        """The write admitted by `begin_write` ended; `digest` is what it wrote (None: it failed midway, the
        block's content is unknown). A conflicting second digest for a block fails the transfer."""
        lease = self.leases[transfer_id]
        lease.inflight.discard(index)
        if not lease.state.ended:
            if digest is None:
                lease.digests.pop(index, None)
            elif lease.digests.setdefault(index, digest) != digest:
                self._end(lease, LeaseState.FAILED)
        self._maybe_release(lease)

    def expect(self, transfer_id: str, digests: list[bytes]) -> bool:
        """The sender's Done: the digest of every block. False if the transfer is not live or the count is
        wrong (the transfer then fails)."""
        lease = self.leases.get(transfer_id)
        if lease is None or lease.state.ended:
            return False
        if len(digests) != len(lease.blocks) or (lease.expected is not None and lease.expected != digests):
            self._end(lease, LeaseState.FAILED)
            self._maybe_release(lease)
            return False
        lease.expected = list(digests)
        return True

    def commit(self, transfer_id: str) -> Lease | None:
        """Hands the lease's blocks (hits first) to the caller's sequence when every block arrived with the digest
        Done lists and the lease is live. None otherwise (a digest mismatch fails the transfer)."""
        lease = self.leases.get(transfer_id)
        if lease is None or lease.state.ended or not lease.complete or lease.inflight:
            return None
        if self.clock() > lease.deadline:
            self.expire()
            return None
        if any(lease.digests[i] != d for i, d in enumerate(lease.expected)):
            self._end(lease, LeaseState.FAILED)
            self._maybe_release(lease)
            return None
        lease.state, lease.released = LeaseState.COMMITTED, True
        self._bury(lease)
        self.counts["succeeded"] += 1
        return lease

    # Endings ----------------------------------------------------------------------------------------------
    def abort(self, transfer_id: str) -> LeaseState | None:
        """Ends the transfer if live (idempotent; a committed or unknown one is left as it is). Returns its state."""
        lease = self.leases.get(transfer_id)
        if lease is None:
            return self._ended.get(transfer_id)
        if not lease.state.ended:
            self._end(lease, LeaseState.ABORTED)
        self._maybe_release(lease)
        return lease.state

    def fail(self, transfer_id: str) -> None:
        lease = self.leases.get(transfer_id)
        if lease is not None and not lease.state.ended:
            self._end(lease, LeaseState.FAILED)
            self._maybe_release(lease)

    def expire(self) -> list[str]:
        """Ends every live lease past its deadline; returns their transfer ids."""
        now = self.clock()
        gone = [t for t, lease in self.leases.items() if not lease.state.ended and now > lease.deadline]
        for t in gone:
            self._end(self.leases[t], LeaseState.EXPIRED)
            self._maybe_release(self.leases[t])
        return gone

    def state(self, transfer_id: str) -> LeaseState | None:
        lease = self.leases.get(transfer_id)
        return lease.state if lease is not None else self._ended.get(transfer_id)

    def _end(self, lease: Lease, state: LeaseState) -> None:
        lease.state = state
        self.counts[{"aborted": "aborted", "expired": "expired"}.get(state.value, "failed")] += 1

    def _maybe_release(self, lease: Lease) -> None:
        """An ended lease gives its blocks back once no write into them is in progress."""
        if not lease.state.ended or lease.released or lease.inflight:
            return
        bm = self.bm
        for b in lease.blocks:
            self.generation[b] += 1  # frames still addressed to it are stale from now on
        bm.unpin(reversed(lease.hit_blocks + lease.blocks))  # never published: the leased ones become free
        lease.released = True
        self._bury(lease)

    def _bury(self, lease: Lease) -> None:
        del self.leases[lease.transfer_id]
        self._ended[lease.transfer_id] = lease.state
        while len(self._ended) > self._tombstones:
            self._ended.popitem(last=False)

    # Accounting -------------------------------------------------------------------------------------------
    @property
    def num_leased(self) -> int:
        return sum(len(lease.blocks) for lease in self.leases.values())

    def block_states(self) -> dict[str, int]:
        """Blocks by state: free, active (referenced by sequences or pinned hits), leased, cached (evictable); with
        an offload tier, offloaded (host blocks)."""
        return block_states(self.bm, self.num_leased)

    def check(self) -> None:
        """free + active + leased + cached == total (the device pool); no free block is leased or written; the
        offload tier holds no more blocks than it has room for."""
        states = self.block_states()
        offloaded = states.pop("offloaded", 0)
        referenced = sum(1 for r in self.bm.ref_counts if r)  # counted, not derived as block_states does
        assert states["free"] + referenced + states["cached"] == self.bm.num_blocks and \
            0 <= states["leased"] <= referenced, f"blocks leaked: {states}, {referenced} referenced of {self.bm.num_blocks}"
        assert self.bm.offload is None or offloaded <= self.bm.offload.num_blocks, "offload tier over its size"
        free = set(self.bm._free)
        assert len(free) == len(self.bm._free), "a block is on the free list twice"
        for lease in self.leases.values():
            for i, b in enumerate(lease.blocks):
                assert b not in free, f"leased block {b} of {lease.transfer_id} is free"
                assert self.bm.ref_counts[b] == 1, f"leased block {b} has ref count {self.bm.ref_counts[b]}"
                if i in lease.inflight:
                    assert b not in free


def block_states(bm: BlockManager, leased: int = 0) -> dict[str, int]:
    """`bm`'s blocks by state, `leased` of the referenced ones held by leases; with an offload tier, also the host
    blocks it holds (offloaded). O(1): referenced = total - free - cached (`TransferLedger.check` counts them)."""
    cached = bm.prefix_cache.num_evictable if bm.prefix_cache else 0
    referenced = bm.num_blocks - len(bm._free) - cached
    states = {"free": len(bm._free), "active": referenced - leased, "leased": leased, "cached": cached}
    if bm.offload is not None:  # host blocks of the offload tier (kv_offload.py), beyond the device pool
        states["offloaded"] = bm.offload.num_offloaded
    return states
