"""Block manager: a fixed pool of ref-counted KV blocks, handed to sequences as block tables."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ..block_hash import block_hashes
from .batch import cdiv
from .prefix_cache import PrefixCache
from .sequence import Sequence


class BlockManager:
    """Owns block ids `[0, num_blocks)`; the tensors themselves live in the model runner.

    A block is free (on `_free`, ref 0), cached-and-evictable (ref 0, owned by the prefix cache's LRU), or
    in use (ref >= 1; ref > 1 only for full, immutable prefix blocks shared between sequences).
    `allocate_slots` is all-or-nothing; `free` returns every block of a sequence. Only the last,
    partially filled block of a sequence is ever written, and it is never shared.

    Reservations: a sequence admitted with `reserve=N` blocks is promised its growth up to N blocks. The blocks
    promised and not yet in its block table are counted in `num_reserved` (no block id is set aside: any free
    one will do). Invariant: `num_free_blocks >= num_reserved`, so a reserved sequence's allocations within its
    reservation always succeed; every other allocation (and a disaggregated transfer's lease) may take only
    `num_available_blocks`.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None) -> None:
        assert num_blocks > 0 and block_size > 0, f"bad pool: {num_blocks} blocks of {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.num_reserved = 0  # blocks promised to reserved sequences' growth, not in their block tables yet
        self.offload = None  # kv_offload.OffloadTier: where evicted prefix blocks go, and come back from
        self.ledger = None  # core/lease.TransferLedger: leases on blocks of this pool (transfers, restores)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: truly free plus cached blocks nobody references."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation outside a reservation may take: the free ones not promised to a reservation."""
        return self.num_free_blocks - self.num_reserved

    @staticmethod
    def num_held_for(seq: Sequence) -> int:
        """The blocks `seq`'s reservation still promises it (0 without one)."""
        return max(0, seq.num_reserved_blocks - len(seq.block_table))

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        covered = seq.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(covered, self.block_size) - len(seq.block_table) - num_computed_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_available_blocks + self.num_held_for(seq)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (which holds no blocks yet). At least one token is left
        uncomputed, since the last prompt position must run through the model to produce logits. Read-only, but
        for blocks the offload tier holds past the device hits: restored into the pool (cached, unreferenced)."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds {len(seq.block_table)} blocks"
        if self.prefix_cache is None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.lora_id,
                              seq.params.cache_salt)
        hits = self.prefix_cache.lookup(hashes[:max_blocks])
        if self.offload is not None and len(hits) < max_blocks:
            hits += self.offload.restore(hashes[len(hits):max_blocks], hits)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Iterable[int] = (),
                       reserve: int = 0) -> bool:
        """Extends `seq.block_table` to cover `computed_blocks` (prefix-cache hits, taken first) and then
        `num_new_tokens` more tokens; with `reserve` (at admission), also promises the sequence its growth up to
        `reserve` blocks in all. Returns False and changes nothing when the pool is too small: blocks within the
        sequence's reservation are always there; the rest must come from `num_available_blocks`."""
        if not computed_blocks and not reserve and self.num_blocks_needed(seq, num_new_tokens) == 0:
            return True  # most decode steps: the last block still has room
        computed_blocks = list(computed_blocks)
        assert not computed_blocks or not seq.block_table, "prefix hits are taken only at admission"
        need = self.num_blocks_needed(seq, num_new_tokens, len(computed_blocks))
        pinned = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)  # evictable hits we take
        held = self.num_held_for(seq)
        target = max(reserve, seq.num_reserved_blocks)
        still_held = max(0, target - len(seq.block_table) - len(computed_blocks) - need)
        # afterwards num_free_blocks - need - pinned >= num_reserved - held + still_held must hold
        if need + pinned + still_held - held > self.num_available_blocks:
            return False
        self.pin(computed_blocks)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            seq.num_registered_blocks = len(computed_blocks)  # already in the cache
        seq.block_table.extend(self._take_free_block() for _ in range(need))
        seq.num_reserved_blocks = target
        self.num_reserved += still_held - held
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks `seq` has completely computed to the prefix cache (after a forward step)."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.lora_id,  # extends in place
                              seq.params.cache_salt)
        for i in range(seq.num_registered_blocks, num_full):
            self.prefix_cache.insert(hashes[i], seq.block_table[i])
        seq.num_registered_blocks = num_full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drops the tail blocks of `seq` past its first `num_tokens` tokens (KV slots of rejected draft tokens);
        they were never published to the prefix cache, so nobody else holds them."""
        keep = cdiv(num_tokens, self.block_size)
        held = self.num_held_for(seq)
        for b in seq.block_table[keep:]:
            assert self.ref_counts[b] == 1, f"tail block {b} of seq {seq.seq_id} has ref count {self.ref_counts[b]}"
            self.ref_counts[b] = 0
            self._free.append(b)
        del seq.block_table[keep:]
        self.num_reserved += self.num_held_for(seq) - held  # slots of its reservation given back to it

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first, so the LRU evicts a prefix's last blocks before its first, and
        its reservation."""
        self.num_reserved -= self.num_held_for(seq)
        seq.num_reserved_blocks = 0
        self.unpin(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0

    def pin(self, blocks: Iterable[int]) -> None:
        """Takes a reference on each of `blocks` (cached ones stop being evictable)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                self.prefix_cache.touch(b)
            self.ref_counts[b] += 1

    def unpin(self, blocks: Iterable[int]) -> None:
        """Drops a reference on each of `blocks`; one left unreferenced stays cached (evictable) or is freed."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"block {b} freed with ref count {self.ref_counts[b]}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0 and not (self.prefix_cache and self.prefix_cache.release(b)):
                self._free.append(b)

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self.prefix_cache.evict() if self.prefix_cache else None
            assert block is not None, "no free KV block: allocate_slots checked capacity"
        assert self.ref_counts[block] == 0, f"block {block} taken from the free pool with ref count"
        self.ref_counts[block] = 1
        return block

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Debug/test helper: ref counts equal the references held by `live` sequences; pools are disjoint."""
        expected = [0] * self.num_blocks
        held = 0
        for seq in live:
            held += self.num_held_for(seq)
            for b in seq.block_table:
                expected[b] += 1
        assert expected == self.ref_counts, "ref counts disagree with the block tables of live sequences"
        assert held == self.num_reserved, f"{self.num_reserved} blocks reserved, live sequences hold {held}"
        assert self.num_free_blocks >= self.num_reserved, \
            f"{self.num_reserved} blocks promised to reservations but {self.num_free_blocks} free"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in free:
            assert self.ref_counts[b] == 0, f"free block {b} has ref count {self.ref_counts[b]}"
            assert not (self.prefix_cache and self.prefix_cache.is_cached(b)), f"free block {b} is cached"
        assert len(free) + sum(1 for r in self.ref_counts if r) + (
            self.prefix_cache.num_evictable if self.prefix_cache else 0) == self.num_blocks, "blocks leaked"


class SwapSpace:
    """Block ids of the CPU swap pool `[0, num_blocks)` (bookkeeping only; the runner owns the tensors).

    A sequence preempted by swap takes `len(block_table)` CPU blocks; they are returned when it is swapped
    back in or finished. No sharing, so no ref counts.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0, f"bad swap space: {num_blocks} blocks"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), f"need {n} swap blocks, {len(self._free)} free"
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        assert len(self._free) <= self.num_blocks, "a swap block was freed twice"

