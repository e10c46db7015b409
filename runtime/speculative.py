"""The speculative step: a draft head proposes a token per sequence, the next step's target forward verifies it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SpeculativeConfig
from .model_runner import DraftInput, LogitsLayout, ModelRunner
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass(slots=True)
class Launched:
    """A batch's forward pass and sampling, done before any of the engine's state changes (so that a failure
    up to here can be retried on parts of the batch). Speculative steps add the tokens each sequence gains
    (verified drafts) and what the draft head reads afterwards."""

    sampled: SamplerOutput
    new_tokens: list[list[int]] | None = None
    draft_input: DraftInput | None = None
    starts: list[int] | None = None


class SpeculativeDecoder:
    """Decoding with the artifact's draft head (`config.model_method`, e.g. DeepSeek's MTP).

    After each step the head proposes one token per sequence (its argmax), and the next step verifies it with
    the target model: the target's token after the last one is sampled as usual, the draft is accepted when
    it equals it, and then the target's token after the draft is sampled too. For a greedy request that is
    plain greedy decoding; for a sampled one it is rejection sampling against a one-point draft distribution
    (accept d with probability p(d), else sample p without d), so tokens follow the target distribution
    exactly. Requests with penalties or logprobs decode one token a step (`drafts_for`).
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, sampler: Sampler, max_model_len: int) -> None:
        self.config = config
        self.runner = runner
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # drafts verified so far, and of them accepted
        self.num_accepted_tokens = 0

    @staticmethod
    def drafts_for(seq: Sequence) -> bool:
        """Requests without penalties (they would have to count the drafts) or logprobs (one row a step)."""
        p = seq.params
        return not p.has_penalties and p.logprobs is None and p.prompt_logprobs is None

    def launch(self, batch: ScheduledBatch) -> Launched:
        """schedule (drafting seqs run their last token + drafts) -> target forward keeping hidden states ->
        sample / verify (the longest draft prefix equal to the target's tokens, plus the target's next token).
        The engine's commit then updates (rejected drafts' KV rolled back) and calls `propose`."""
        seqs = batch.seqs
        draft_input = None
        if any(self.drafts_for(seq) for seq in seqs):
            logits, layout, draft_input = self.runner.execute_with_hidden(batch)
        else:
            logits, layout = self.runner.execute(batch)
        sampled = self.sampler.sample(logits, layout, seqs)
        starts = [seq.num_computed_tokens for seq in seqs]
        return Launched(sampled, self.verify(batch, logits, layout, sampled.sampled), draft_input, starts)

    def verify(self, batch: ScheduledBatch, logits: torch.Tensor, layout: LogitsLayout,
               sampled: list[int | None]) -> list[list[int]]:
        """Per seq, the tokens it gains: a verifying seq's accepted drafts (each equal to the target's token
        sampled at its position), then the target's token after the last accepted one."""
        out = [[] if t is None else [t] for t in sampled]
        verifying = [i for i, seq in enumerate(batch.seqs) if seq.draft_token_ids]
        if not verifying:
            return out
        mask_drafts = getattr(self.sampler.logits_processor, "mask_drafts", None)
        if mask_drafts is not None:  # constrained seqs: a draft the grammar rejects is rejected below
            mask_drafts(logits, [batch.seqs[i] for i in verifying], [layout.sample_rows[i] for i in verifying])
        row_seqs = [batch.seqs[i] for i in verifying for _ in batch.seqs[i].draft_token_ids]
        rows = [layout.sample_rows[i] + 1 + j for i in verifying for j in range(len(batch.seqs[i].draft_token_ids))]
        targets = self.sampler.sample_tokens(logits[rows], row_seqs)
        k = 0
        for i in verifying:
            drafts = batch.seqs[i].draft_token_ids
            after = targets[k:k + len(drafts)]  # the target's token after each draft
            k += len(drafts)
            accepted = out[i]
            for d, t in zip(drafts, after):
                if accepted[-1] != d:
                    break
                accepted.append(t)
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += len(accepted) - 1
        return out

    def propose(self, batch: ScheduledBatch, launched: Launched) -> None:
        """Runs the draft head over the step's tokens (keeping its KV complete for every computed position) and
        stores a draft for each seq that drafts (`drafts_for`) and goes on decoding."""
        input_ids: list[int] = []
        rows: list[int] = []
        wanting: list[Sequence] = []
        k = self.config.num_tokens
        for seq, n, start, tokens in zip(batch.seqs, batch.num_new_tokens, launched.starts, launched.new_tokens,
                                         strict=True):
            ids = seq.token_ids[start + 1:start + 1 + n]  # token t+1 at position t
            base = len(input_ids)
            input_ids.extend(ids + [0] * (n - len(ids)))  # rows past a rejected draft: unread
            if (tokens and seq.finish_reason is None and self.drafts_for(seq)
                    and seq.num_tokens + k <= self.max_model_len
                    and seq.num_output_tokens + 1 < seq.max_tokens):
                rows.append(base + seq.num_computed_tokens - 1 - start)  # the last position with valid KV
                wanting.append(seq)
        drafts = self.runner.propose(self.config.model_method, launched.draft_input, input_ids, rows)
        for seq, d in zip(wanting, drafts, strict=True):
            seq.draft_token_ids = [d]
