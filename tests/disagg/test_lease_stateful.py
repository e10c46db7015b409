"""Stateful property test of the decode side's lease ledger over interleavings of reserve / begin_write /
end_write / done / commit / abort / expire / free, with ordinary sequences competing for the same pool, and the
CPU offload tier (runtime/core/kv_offload.py) over the same ledger: evictions offload, restores (start / copy one block
/ finish / abort) lease their destination blocks like a transfer.

The model tracks every write in progress (a transfer's frame or a restore's copy) independently of the ledger;
after every step: no block is both free (or owned by another transfer or sequence) and the target of a write in
progress, free + active + leased + cached == total on the device, and the tier's host slots are free or hold a
block (within its size); a restored block holds what was offloaded under its hash."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.kv_offload import OffloadTier
from kiln.runtime.core.lease import LeaseState, TransferLedger
from kiln.runtime.core.prefix_cache import PrefixCache

NUM_BLOCKS = 12
HOST_BLOCKS = 5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class LedgerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.clock = Clock()
        self.bm = BlockManager(NUM_BLOCKS, 4, PrefixCache())
        self.ledger = TransferLedger(self.bm, lease_s=10.0, clock=self.clock, tombstones=8)
        # one layer, a block is 2 numbers: [hash, block id] of what was computed into it
        self.kv = [torch.full((NUM_BLOCKS, 2), -1.0, dtype=torch.float64)]
        self.tier = OffloadTier(self.bm, self.kv, HOST_BLOCKS)
        self.restores: list = []  # restores in progress
        self.copies: dict[tuple[str, int], tuple[object, int]] = {}  # (transfer, index) -> (restore, block)
        self.next_hash = 0
        for _ in range(3):  # the tier starts with blocks in it: computed, published, released, evicted
            b = self.bm._take_free_block()
            self.bm.prefix_cache.insert(self.next_hash, b)
            self.kv[0][b] = torch.tensor([self.next_hash, b], dtype=torch.float64)
            self.next_hash += 1
            self.bm.unpin([b])
            assert self.bm.prefix_cache.evict() == b
            self.bm._free.append(b)
        self.next_id = 0
        self.writes: dict[tuple[str, int], int] = {}  # (transfer, index) -> block id, writes in progress
        self.seqs: list[SimpleNamespace] = []  # committed transfers' and ordinary sequences' block tables
        self.all_ids: list[str] = []

    # Transfers --------------------------------------------------------------------------------------------
    @rule(n=st.integers(0, 5), hits=st.integers(0, 3))
    def reserve(self, n: int, hits: int) -> None:
        cached = list(self.bm.prefix_cache._hash_of)[:hits]
        tid = f"t{self.next_id}"
        self.next_id += 1
        before = self.ledger.block_states()
        lease = self.ledger.reserve(tid, n, cached)
        self.all_ids.append(tid)
        if lease is None:
            assert self.ledger.block_states() == before
        else:
            assert len(set(lease.blocks)) == n and not set(lease.blocks) & set(self.bm._free)

    def _live(self) -> list[str]:
        return [t for t, lease in self.ledger.leases.items() if not lease.state.ended]

    @precondition(lambda self: self.all_ids)
    @rule(data=st.data(), stale=st.booleans())
    def begin_write(self, data, stale: bool) -> None:
        tid = data.draw(st.sampled_from(self.all_ids))
        lease = self.ledger.leases.get(tid)
        if lease is None or not lease.blocks:
            # a late frame for an ended transfer, addressed to some block: refused
            block = data.draw(st.integers(0, NUM_BLOCKS - 1))
            assert not self.ledger.begin_write(tid, 0, block, self.ledger.generation[block])
            return
        idx = data.draw(st.integers(0, len(lease.blocks) - 1))
        gen = lease.generations[idx] - (1 if stale else 0)
        ok = self.ledger.begin_write(tid, idx, lease.blocks[idx], gen)
        live = not lease.state.ended and self.clock.now <= lease.deadline
        assert ok == (live and not stale and (tid, idx) not in self.writes)
        if ok:
            self.writes[(tid, idx)] = lease.blocks[idx]

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), outcome=st.sampled_from(["good", "corrupt", "broken"]))
    def end_write(self, data, outcome: str) -> None:
        tid, idx = data.draw(st.sampled_from(sorted(self.writes)))
        digest = {"good": f"{tid}/{idx}".encode(), "corrupt": b"other", "broken": None}[outcome]
        self.ledger.end_write(tid, idx, digest)
        del self.writes[(tid, idx)]

    @precondition(lambda self: self.all_ids)
    @rule(data=st.data(), wrong=st.booleans())
    def done(self, data, wrong: bool) -> None:
        tid = data.draw(st.sampled_from(self.all_ids))
        lease = self.ledger.leases.get(tid)
        n = len(lease.blocks) if lease else 1
        self.ledger.expect(tid, [f"{tid}/{i}".encode() for i in range(n + (1 if wrong else 0))])

    @precondition(lambda self: self.all_ids)
    @rule(data=st.data())
    def commit(self, data) -> None:
        tid = data.draw(st.sampled_from(self.all_ids))
        lease = self.ledger.commit(tid)
        if lease is None:
            return
        assert lease.state is LeaseState.COMMITTED
        assert all(lease.digests[i] == f"{tid}/{i}".encode() for i in range(len(lease.blocks)))
        seq = SimpleNamespace(block_table=lease.hit_blocks + lease.blocks, num_registered_blocks=0,
                              num_reserved_blocks=0)
        for b in lease.blocks:  # what the engine does: publish the received full blocks
            self.bm.prefix_cache.insert(self.next_hash, b)
            self.kv[0][b] = torch.tensor([self.next_hash, b], dtype=torch.float64)
            self.next_hash += 1
        self.seqs.append(seq)

    @precondition(lambda self: self.all_ids)
    @rule(data=st.data())
    def abort(self, data) -> None:
        tid = data.draw(st.sampled_from(self.all_ids))
        first = self.ledger.abort(tid)
        assert self.ledger.abort(tid) == first  # idempotent

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt
        self.ledger.expire()

    # Ordinary sequences competing for blocks --------------------------------------------------------------
    @rule(n=st.integers(1, 4), publish=st.booleans())
    def allocate(self, n: int, publish: bool) -> None:
        if n <= self.bm.num_free_blocks:
            seq = SimpleNamespace(block_table=[self.bm._take_free_block() for _ in range(n)], num_registered_blocks=0,
                                  num_reserved_blocks=0)
            for b in seq.block_table:  # the sequence computes into them: what an eviction offloaded is gone here
                self.kv[0][b] = -2.0
                if publish:  # full blocks, published to the prefix cache (evictable, so offloaded, once freed)
                    self.bm.prefix_cache.insert(self.next_hash, b)
                    self.kv[0][b] = torch.tensor([self.next_hash, b], dtype=torch.float64)
                    self.next_hash += 1
            self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.bm.free(seq)

    # The offload tier -------------------------------------------------------------------------------------
    @precondition(lambda self: self.tier.num_offloaded)
    @rule(data=st.data(), hits=st.integers(0, 2))
    def restore_start(self, data, hits: int) -> None:
        offloaded = [h for h in self.tier._slot_of if not self.bm.prefix_cache.holds(h)]
        if not offloaded:
            return
        chain = data.draw(st.lists(st.sampled_from(offloaded), min_size=1, max_size=3, unique=True))
        front = list(self.bm.prefix_cache._hash_of)[:hits]
        before = self.ledger.block_states()
        pending = self.tier.start(chain, front)
        if pending is None:
            assert self.ledger.block_states() == before
            return
        self.restores.append(pending)
        for i, b in enumerate(pending.lease.blocks):
            self.copies[(pending.lease.transfer_id, i)] = (pending, b)

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def restore_copy(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.copies)))
        pending, _ = self.copies.pop(key)
        self.tier.copy(pending, key[1])

    @precondition(lambda self: self.restores)
    @rule(data=st.data())
    def restore_abort(self, data) -> None:
        pending = self.restores.pop(data.draw(st.integers(0, len(self.restores) - 1)))
        self.tier.abort(pending)
        self.tier.abort(pending)  # idempotent

    @precondition(lambda self: self.restores)
    @rule(data=st.data())
    def restore_finish(self, data) -> None:
        pending = self.restores.pop(data.draw(st.integers(0, len(self.restores) - 1)))
        for key in sorted(k for k in self.copies if k[0] == pending.lease.transfer_id):  # its copies end first
            self.copies.pop(key)
            self.tier.copy(pending, key[1])
        hashes = list(pending.hashes)
        blocks = self.tier.finish(pending)
        for h, b in zip(hashes, blocks):  # published, unreferenced, holding what was offloaded under h
            assert self.bm.prefix_cache.holds(h) and self.bm.ref_counts[b] == 0
            assert self.kv[0][b, 0].item() == h, f"restored block {b} holds {self.kv[0][b].tolist()}, not {h}"

    # Invariants -------------------------------------------------------------------------------------------
    @invariant()
    def no_write_into_a_reusable_block(self) -> None:
        if not hasattr(self, "ledger"):
            return
        free = set(self.bm._free) | set(self.bm.prefix_cache._evictable)
        owned_elsewhere: dict[int, str] = {}
        for seq in self.seqs:
            for b in seq.block_table:
                owned_elsewhere[b] = "seq"
        for t, lease in self.ledger.leases.items():
            for b in lease.blocks:
                owned_elsewhere[b] = t
        writes = {**self.writes, **{key: block for key, (_, block) in self.copies.items()}}
        for (tid, _), block in writes.items():
            assert block not in free, f"block {block} is free while {tid} writes into it"
            assert owned_elsewhere.get(block) == tid, f"block {block} written by {tid} is owned by " \
                                                      f"{owned_elsewhere.get(block)}"

    @invariant()
    def accounting(self) -> None:
        if hasattr(self, "ledger"):
            self.tier.check()  # host free + offloaded == its size, and the ledger's device accounting


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase
