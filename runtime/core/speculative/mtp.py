"""The `mtp` proposer: the artifact's draft head (DeepSeek's multi-token prediction layer) drafts up to k tokens,
the head applied again on its own hidden state for drafts 2..k (chained, as DeepSeek-V3's one MTP module is)."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ...config import SpeculativeConfig
from ...worker.interface import DraftInput
from ..batch import ScheduledBatch
from . import Launched, Proposer


class MTPProposer(Proposer):
    """A draft head compiled into the artifact (`config.model_method`, a method of its model.py): at position t
    it reads the target's hidden state there and token t+1, writes its own KV layers, and predicts token t+2.

    It runs over every token of every step (its KV must be complete for each computed position, drafting or
    not) and drafts its argmax at each drafting sequence's last position with valid KV. Drafts 2..k: the head
    again, one position on, reading its own hidden state and the previous draft, its KV written at the slots the
    next verify step computes (a position without a slot yet ends the chain there). Those rows are rewritten
    from the target's hidden states by the next step's run over its tokens, so accepted and rejected drafts
    leave the head's KV as if it had only ever read the target's."""

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
        if max(limits, default=1) == 1:
            return [[d] for d in self.runner.propose(self.method, launched.draft_input, input_ids, rows)]
        first, hidden = self.runner.propose(self.method, launched.draft_input, input_ids, rows, with_hidden=True)
        drafts = [[d] for d in first]
        if hidden is not None:
            self._chain(batch, wanting, limits, drafts, hidden)
        return drafts

    def _chain(self, batch: ScheduledBatch, wanting: list[int], limits: list[int], drafts: list[list[int]],
               hidden: torch.Tensor) -> None:
        """Drafts 2..limit in place: round r runs the head at position num_computed + r - 1 of each sequence still
        chaining, on draft r and the head's hidden state of round r - 1."""
        bs = self.runner.block_size
        live = list(range(len(wanting)))
        for r in range(1, max(limits)):
            live = [j for j in live if limits[j] > r and
                    (batch.seqs[wanting[j]].num_computed_tokens + r - 1) // bs < len(batch.seqs[wanting[j]].block_table)]
            if not live:
                return
            shadows = []
            for j in live:  # decodes at the chained position: the sequence's slots and block table
                seq = copy.copy(batch.seqs[wanting[j]])
                seq.token_ids = seq.token_ids + drafts[j]
                seq.num_computed_tokens += r - 1
                shadows.append(seq)
            host, _ = self.runner.plan(ScheduledBatch(seqs=shadows, num_new_tokens=[1] * len(live),
                                                      num_decodes=len(live)))
            index = torch.tensor(live, device=hidden.device)
            tokens, h = self.runner.propose(self.method, DraftInput(self.runner.forward_batch(host), hidden[index]),
                                            [drafts[j][-1] for j in live], list(range(len(live))), with_hidden=True)
            hidden = hidden.index_copy(0, index, h)
            for j, t in zip(live, tokens, strict=True):
                drafts[j].append(t)
