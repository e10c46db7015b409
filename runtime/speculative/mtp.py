"""The `mtp` proposer: the artifact's draft head (DeepSeek's multi-token prediction layer) drafts one token."""
from __future__ import annotations

from typing import Any

from ..config import SpeculativeConfig
from ..scheduler import ScheduledBatch
from . import Launched, Proposer


class MTPProposer(Proposer):
    """A draft head compiled into the artifact (`config.model_method`, a method of its model.py): at position t
    it reads the target's hidden state there and token t+1, writes its own KV layers, and predicts token t+2.

    It runs over every token of every step (its KV must be complete for each computed position, drafting or
    not) and proposes its argmax at each drafting sequence's last position with valid KV: one token a step."""

    needs_hidden = True

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        self.method = config.model_method
        self.runner = runner

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        input_ids: list[int] = []
        rows: list[int] = []
        want = set(wanting)
        for i, (seq, n, start) in enumerate(zip(batch.seqs, batch.num_new_tokens, launched.starts, strict=True)):
            ids = seq.token_ids[start + 1:start + 1 + n]  # token t+1 at position t
            base = len(input_ids)
            input_ids.extend(ids + [0] * (n - len(ids)))  # rows past a rejected draft: unread
            if i in want:
                rows.append(base + seq.num_computed_tokens - 1 - start)  # the last position with valid KV
        drafts = self.runner.propose(self.method, launched.draft_input, input_ids, rows)
        return [[d] for d in drafts]
