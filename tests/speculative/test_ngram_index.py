"""Prompt lookup's index: the longest suffix n-gram found wins, its latest earlier occurrence gives the draft, and
an index grown token by token answers as one built at once."""
from __future__ import annotations

import random

from kiln.runtime.core.speculative.ngram import NgramIndex


def test_longest_suffix_and_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 6, 7]
    # suffix (9, 6, 7) and (6, 7) ... : (6, 7) occurs at 1-2 (then 8) and 5-6 (then 9, 6, 7): the latest wins
    assert index.lookup(tokens, 3) == [9, 6, 7]
    assert index.lookup(tokens, 1) == [9]
    # a 3-gram match beats a more recent 2-gram one: (1, 6, 7) occurred once, followed by 9
    tokens2 = [1, 6, 7, 9, 4, 6, 7, 2, 1, 6, 7]
    assert NgramIndex(1, 3).lookup(tokens2, 2) == [9, 4]
    assert NgramIndex(2, 3).lookup([1, 2, 3, 4], 4) == []  # no earlier occurrence of any suffix
    assert NgramIndex(2, 2).lookup([1, 2, 3, 1], 4) == []  # unigram matches are below min_n
    assert NgramIndex(1, 2).lookup([1, 2, 3, 1], 4) == [2, 3, 1]  # the continuation may run into the suffix


def test_incremental_equals_fresh():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(12)]
    grown = NgramIndex(1, 4)
    for _ in range(60):
        tokens.append(rng.randrange(6))
        assert grown.lookup(tokens, 4) == NgramIndex(1, 4).lookup(tokens, 4)
