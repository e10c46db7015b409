"""Block manager and prefix cache: ref counts, all-or-nothing allocation, sharing, LRU eviction."""
from __future__ import annotations

import itertools

import pytest
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.prefix_cache import PrefixCache
from kiln.runtime.core.sequence import Sequence
from kiln.runtime.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    n = next(_ids)
    return Sequence(seq_id=n, request_id=str(n), index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(), max_tokens=16, arrival=n)


def test_allocate_append_free_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(10))), make_seq(list(range(5)))
    assert bm.allocate_slots(a, 10) and len(a.block_table) == 3
    assert bm.allocate_slots(b, 5) and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2) and len(a.block_table) == 3  # 12 tokens still fit in 3 blocks
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 1) and len(a.block_table) == 4
    bm.check_invariants([a, b])
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8
    bm.check_invariants([])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(list(range(12))), make_seq(list(range(8)))
    assert bm.allocate_slots(a, 12)
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([a, b])


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq([1, 2, 3])
    bm.allocate_slots(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="ref count"):
        bm.free(a)


def _run_prefill(bm: BlockManager, seq: Sequence) -> None:
    hits = bm.get_computed_blocks(seq)
    cached = len(hits) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - cached, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_prefix_blocks_are_shared_and_survive_their_owner():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache=PrefixCache())
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_seq(prompt)
    _run_prefill(bm, a)
    b = make_seq(prompt + [7, 8])  # 3 full blocks
    assert bm.get_computed_blocks(b) == a.block_table[:2]
    _run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8  # cached blocks count as free (evictable)
    assert bm.prefix_cache.num_evictable == 3  # a's 2 shared blocks + b's third (full) block
    c = make_seq(prompt)
    assert len(bm.get_computed_blocks(c)) == 2  # reused after both owners finished
    bm.check_invariants([])


def test_full_prompt_hit_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache=PrefixCache())
    a = make_seq(list(range(8)))
    _run_prefill(bm, a)
    b = make_seq(list(range(8)))
    assert len(bm.get_computed_blocks(b)) == 1  # not 2: the last token must run to produce logits


def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(num_blocks=4, block_size=2, prefix_cache=PrefixCache())
    old, new = make_seq([1, 2, 3]), make_seq([5, 6, 7])
    for s in (old, new):
        _run_prefill(bm, s)
    bm.free(old)
    bm.free(new)
    assert bm.prefix_cache.num_evictable == 2 and bm.num_free_blocks == 4
    hog = make_seq(list(range(50, 57)))  # needs all 4 blocks: 2 free + both evictable ones
    big = make_seq(list(range(50, 55)))  # needs 3: free list first, then evicts `old`'s block
    assert bm.allocate_slots(big, 5)
    assert bm.get_computed_blocks(make_seq([1, 2, 3])) == []
    assert len(bm.get_computed_blocks(make_seq([5, 6, 7]))) == 1
    bm.free(big)
    assert bm.allocate_slots(hog, 7)
    bm.check_invariants([hog])


def test_taking_an_evictable_hit_counts_against_capacity():
    bm = BlockManager(num_blocks=2, block_size=2, prefix_cache=PrefixCache())
    a = make_seq([1, 2, 3])
    _run_prefill(bm, a)
    bm.free(a)  # block [1,2] cached+evictable, other block free
    b = make_seq([1, 2, 3, 4, 5])  # hit 1 block, needs 2 more: only 1 left once the hit is pinned
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1
    assert not bm.allocate_slots(b, 3, hits)
    assert b.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([])
