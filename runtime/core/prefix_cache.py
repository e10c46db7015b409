"""Automatic prefix caching over full KV blocks: hash-chained block keys, LRU eviction of unreferenced blocks."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq

from ..block_hash import BlockHash

MAX_EVENTS = 1 << 16  # prefix-cache events kept for a follower between two drains
class PrefixCache:
    """Maps block hash -> physical block id for blocks whose K/V is complete and immutable.

    A cached block is either referenced by some sequence, or unreferenced and *evictable*: it sits in an LRU
    list and is reclaimed (its hash forgotten) only when the free list is empty. `lookup` never modifies the
    cache; the block manager pins hits through `touch` before handing them to a sequence.
    Invariant: a block id is in `_evictable` iff it is cached and its ref count is 0.

    A KV-aware router follows what the cache holds through its events (`record_events`, `take_events`): every
    hash published and every hash evicted, in order. Nothing is recorded until someone asks.
    """

    name = "hash"

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # block id -> None, oldest first
        self.queries = 0
        self.hits = 0
        self._events: list[tuple[bool, BlockHash]] | None = None  # (published?, hash), oldest first, while followed
        self._events_lost = False  # a reset since the last take: the follower re-reads `cached_hashes`
        self.on_evict: Callable[[BlockHash, int], None] | None = None  # (hash, block id) before reuse: the offload tier

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of

    def lookup(self, hashes: Seq[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (read-only)."""
        hit: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hit.append(block)
        self.queries += len(hashes)
        self.hits += len(hit)
        return hit

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Registers a just-filled block; False when another block already holds this content."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if self._events is not None:
            self._record(True, block_hash)
        return True

    def touch(self, block_id: int) -> None:
        """A sequence takes a reference on a cached block: it stops being evictable."""
        self._evictable.pop(block_id, None)

    def release(self, block_id: int) -> bool:
        """The last reference was dropped; True when the block stays cached (evictable) instead of freed."""
        if block_id not in self._hash_of:
            return False
        self._evictable[block_id] = None
        return True

    def evict(self) -> int | None:
        """Forgets the least recently released block and returns its id for reuse."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        if self._events is not None:
            self._record(False, block_hash)
        if self.on_evict is not None:
            self.on_evict(block_hash, block_id)
        return block_id

    def reset(self) -> None:
        self._block_of.clear()
        self._hash_of.clear()
        self._evictable.clear()
        if self._events is not None:
            self._events.clear()
            self._events_lost = True

    # Events, for a router that follows this cache (runtime/disagg/router.py) --------------------------------
    def record_events(self) -> None:
        """Starts recording published and evicted hashes (idempotent)."""
        if self._events is None:
            self._events = []

    def _record(self, published: bool, block_hash: BlockHash) -> None:
        if len(self._events) >= MAX_EVENTS:  # nobody drained them for long: the follower re-reads everything
            self._events.clear()
            self._events_lost = True
        self._events.append((published, block_hash))

    def take_events(self) -> list[tuple[bool, BlockHash]] | None:
        """The (published?, hash) events since the last call, oldest first, and forgets them; None when the cache
        was reset meanwhile (the follower then re-reads `cached_hashes`)."""
        events, self._events = self._events, []
        if self._events_lost:
            self._events_lost = False
            return None
        return events or []

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now (referenced or evictable)."""
        return list(self._block_of)


PREFIX_CACHES: dict[str, Callable[[], PrefixCache]] = {
    # The manifest's "radix" is served by the block-hash chain: at block granularity a hash chain matches exactly
    # the prefixes a radix tree over token blocks would, with O(1) lookups per block.
    "radix": PrefixCache,
    "hash": PrefixCache,
}


def make_prefix_cache(name: str | None) -> PrefixCache | None:
    if name is None:
        return None
    try:
        return PREFIX_CACHES[name]()
    except KeyError:
        from ..errors import ArtifactError
        raise ArtifactError(f"unknown prefix_cache {name!r} (known: {', '.join(PREFIX_CACHES)}, none)") from None
