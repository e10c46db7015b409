"""Stateful property test of the decode side's lease ledger over interleavings of reserve / begin_write /
end_write / done / commit / abort / expire / free, with ordinary sequences competing for the same pool.

The model tracks every write in progress independently of the ledger; after every step: no block is both
free (or owned by another transfer or sequence) and the target of a write in progress, and
free + active + leased + cached == total."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kiln.runtime.disagg.lease import LeaseState, TransferLedger
from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.prefix_cache import PrefixCache

NUM_BLOCKS = 12


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
        self.next_id = 0
        self.writes: dict[tuple[str, int], int] = {}  # (transfer, index) -> block id, writes in progress
        self.seqs: list[SimpleNamespace] = []  # committed transfers' and ordinary sequences' block tables
        self.all_ids: list[str] = []
        self.next_hash = 0

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
    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n <= self.bm.num_free_blocks:
            seq = SimpleNamespace(block_table=[self.bm._take_free_block() for _ in range(n)], num_registered_blocks=0,
                                  num_reserved_blocks=0)
            self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.bm.free(seq)

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
        for (tid, _), block in self.writes.items():
            assert block not in free, f"block {block} is free while {tid} writes into it"
            assert owned_elsewhere.get(block) == tid, f"block {block} written by {tid} is owned by " \
                                                      f"{owned_elsewhere.get(block)}"

    @invariant()
    def accounting(self) -> None:
        if hasattr(self, "ledger"):
            self.ledger.check()


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase
