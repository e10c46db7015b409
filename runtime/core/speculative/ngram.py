"""The `ngram` proposer: prompt lookup. The sequence's last n tokens are looked up earlier in its own tokens
(prompt and output), and what followed there is the draft; no model runs."""
from __future__ import annotations

from typing import Any

from ...config import SpeculativeConfig
from ..batch import ScheduledBatch
from . import Launched, Proposer, SeqStates


class NgramIndex:
    """Where each n-gram of a token list (`min_n` <= n <= `max_n`) last ended, for every end position before
    the list's last one; built incrementally, as a sequence only ever grows by appended tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.ns = range(max_n, min_n - 1, -1)  # longest first: a longer match predicts better
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the latest position right after one of its occurrences
        self.indexed = 1  # end positions below this are in `ends`

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` found
        (an n-gram of `min_n` to `max_n` tokens); empty when none occurs before."""
        length = len(tokens)
        ends, ns = self.ends, self.ns
        for e in range(self.indexed, length):  # occurrences ending at e < length: their continuation exists
            for n in ns:
                if n <= e:
                    ends[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, length)
        for n in ns:
            if n <= length:
                e = ends.get(tuple(tokens[length - n:]))
                if e is not None:
                    return tokens[e:e + k]
        return []


class NgramProposer(Proposer):
    """Drafts by prompt lookup (`NgramIndex`, one per sequence, kept while it runs). Cheap, and right where the
    output repeats its context: code edits, summaries and extraction quoting the prompt, loops."""

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        self.indexes: SeqStates[NgramIndex] = SeqStates(lambda seq: NgramIndex(config.ngram_min, config.ngram_max))

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        self.indexes.prune()
        return [self.indexes.get(batch.seqs[i]).lookup(batch.seqs[i].token_ids, k)
                for i, k in zip(wanting, limits, strict=True)]
