"""Block manager: a fixed pool of ref-counted KV blocks, handed to sequences as block tables."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .prefix_cache import PrefixCache, block_hashes
from .sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns block ids `[0, num_blocks)`; the tensors themselves live in the model runner.

    A block is free (on `_free`, ref 0), cached-and-evictable (ref 0, owned by the prefix cache's LRU), or
    in use (ref >= 1; ref > 1 only for full, immutable prefix blocks shared between sequences).
    `allocate_slots` is all-or-nothing; `free` returns every block of a sequence. Only the last,
    partially filled block of a sequence is ever written, and it is never shared.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None) -> None:
        assert num_blocks > 0 and block_size > 0, f"bad pool: {num_blocks} blocks of {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: truly free plus cached blocks nobody references."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        covered = seq.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(covered, self.block_size) - len(seq.block_table) - num_computed_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (which holds no blocks yet). Read-only. At least one token is
        left uncomputed, since the last prompt position must run through the model to produce logits."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds {len(seq.block_table)} blocks"
        if self.prefix_cache is None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.lora_id)
        return self.prefix_cache.lookup(hashes[:max_blocks])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Iterable[int] = ()) -> bool:
        """Extends `seq.block_table` to cover `computed_blocks` (prefix-cache hits, taken first) and then
        `num_new_tokens` more tokens. Returns False and changes nothing when the pool is too small."""
        if not computed_blocks and self.num_blocks_needed(seq, num_new_tokens) == 0:
            return True  # most decode steps: the last block still has room
        computed_blocks = list(computed_blocks)
        assert not computed_blocks or not seq.block_table, "prefix hits are taken only at admission"
        need = self.num_blocks_needed(seq, num_new_tokens, len(computed_blocks))
        pinned = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)  # evictable hits we take
        if need > self.num_free_blocks - pinned:
            return False
        self.pin(computed_blocks)
        if computed_blocks:
            seq.block_table.extend(computed_blocks)
            seq.num_registered_blocks = len(computed_blocks)  # already in the cache
        seq.block_table.extend(self._take_free_block() for _ in range(need))
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks `seq` has completely computed to the prefix cache (after a forward step)."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.lora_id)  # extends in place
        for i in range(seq.num_registered_blocks, num_full):
            self.prefix_cache.insert(hashes[i], seq.block_table[i])
        seq.num_registered_blocks = num_full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drops the tail blocks of `seq` past its first `num_tokens` tokens (KV slots of rejected draft tokens);
        they were never published to the prefix cache, so nobody else holds them."""
        keep = cdiv(num_tokens, self.block_size)
        for b in seq.block_table[keep:]:
            assert self.ref_counts[b] == 1, f"tail block {b} of seq {seq.seq_id} has ref count {self.ref_counts[b]}"
            self.ref_counts[b] = 0
            self._free.append(b)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first, so the LRU evicts a prefix's last blocks before its first."""
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
        for seq in live:
            for b in seq.block_table:
                expected[b] += 1
        assert expected == self.ref_counts, "ref counts disagree with the block tables of live sequences"
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

