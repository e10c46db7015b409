"""Speculative decoding: after each step a proposer drafts up to k tokens per sequence, and the next step's one
target forward verifies them (k + 1 positions a sequence, scheduler.py and model_runner.py's verify rows).

Proposers (`PROPOSERS`, imported when chosen): `mtp`, the artifact's draft head (DeepSeek's multi-token
prediction layer; mtp.py); `ngram`, prompt lookup in the sequence's own tokens (ngram.py); `draft`, a second,
smaller artifact sharing the tokenizer, with its own KV pool (draft.py); `eagle`, an EAGLE head over the
target's hidden states (EAGLE-1/2: its last ones; EAGLE-3: three layers' of them), chained k times (eagle.py,
eagle3.py).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from ...config import SpeculativeConfig
from ...worker.interface import DraftInput
from ..batch import LogitsLayout, ScheduledBatch
from ..sampler import NONFINITE_TOKEN, Sampler, SamplerOutput, apply_logit_bias
from ..sequence import Sequence

if TYPE_CHECKING:
    from ...artifact import LoadedArtifact
    from ...worker.interface import Executor


@dataclass(slots=True)
class Launched:
    """A batch's forward pass and sampling, done before any of the engine's state changes (so that a failure
    up to here can be retried on parts of the batch). Speculative steps add the tokens each sequence gains
    (verified drafts), where the step's tokens start per sequence and what a draft head reads afterwards."""

    sampled: SamplerOutput
    new_tokens: list[list[int]] | None = None
    draft_input: DraftInput | None = None
    starts: list[int] | None = None


@dataclass(frozen=True, slots=True)
class PoolShare:
    """Device memory a proposer takes beside the target's KV pool, planned with it (memory_plan.py) so that the
    two fit the budget together: `per_block` bytes for each block of the target's pool (a pool of its own sized
    to the target's token slots: a draft model's KV, an EAGLE head's one layer) and `fixed` bytes (its weights,
    loaded after the plan; the slots it adds per sequence it may run)."""
    per_block: int = 0
    fixed: int = 0


def draft_path(config: SpeculativeConfig, artifact: LoadedArtifact) -> Path:
    """`config.draft_model`: a directory, or one inside the target artifact (its manifest's draft_model)."""
    path = Path(config.draft_model)
    if not path.is_absolute() and (artifact.path / path).is_dir():
        path = artifact.path / path
    return path


class Proposer:
    """Drafts tokens for the sequences of a step that was just committed.

    `propose(batch, launched, wanting, limits)` runs once the step's tokens are the sequences' (after
    `Scheduler.update_verified`): `batch.seqs[wanting[j]]` goes on decoding and may take up to `limits[j]` >= 1
    drafts; it returns one list of drafts per `wanting` entry (empty: none this step). It changes neither the
    sequences nor the target's KV (a draft head writes its own KV layers, a draft model its own pool). Drafts
    are point proposals: verification accepts a draft where the target, sampling as the request asks, draws
    that very token, which is exact rejection sampling against a one-point draft distribution, so outputs
    follow the target's distribution whatever the proposer drafts. `pool_share(config, artifact)`: the memory it
    will take beside the target's pool, asked before the pool is planned. `needs_hidden`: the target forward also
    returns every token's hidden state (`Launched.draft_input`); with `aux_layers`, the hidden states entering
    those decoder layers instead (an EAGLE-3 head's three)."""

    needs_hidden: ClassVar[bool] = False
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def pool_share(cls, config: SpeculativeConfig, artifact: LoadedArtifact) -> PoolShare:
        return PoolShare()

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        raise NotImplementedError


# method -> "module:class" in this package; each class is built as cls(config, runner, artifact)
PROPOSERS: dict[str, str] = {"ngram": "ngram:NgramProposer", "draft": "draft:DraftModelProposer",
                             "eagle": "eagle:EagleProposer"}
HEAD_PROPOSER = "mtp:MTPProposer"  # any draft head the artifact names (manifest `drafts`)


T = TypeVar("T")


class SeqStates(Generic[T]):
    """State a proposer keeps per sequence between steps (`get` makes it with `new`), dropped once its sequence
    has finished (`prune`, which hands it to `drop` first). A sequence ends in many ways (a token, a stop
    string, an abort, a failure), so finished ones are found by looking, not told."""

    def __init__(self, new: Callable[[Sequence], T], drop: Callable[[T], None] | None = None) -> None:
        self._new, self._drop = new, drop
        self._states: dict[int, tuple[Sequence, T]] = {}

    def get(self, seq: Sequence) -> T:
        entry = self._states.get(seq.seq_id)
        if entry is None:
            entry = self._states[seq.seq_id] = (seq, self._new(seq))
        return entry[1]

    def prune(self) -> None:
        for seq_id in [i for i, (seq, _) in self._states.items() if seq.is_finished]:
            _, state = self._states.pop(seq_id)
            if self._drop is not None:
                self._drop(state)

    def __len__(self) -> int:
        return len(self._states)


def shadow_sequence(seq: Sequence) -> Sequence:
    """A proposer's own `Sequence` following `seq` (same ids and limits, no tokens, no blocks): its block table
    and computed count in the proposer's BlockManager."""
    return Sequence(seq_id=seq.seq_id, request_id=seq.request_id, index=seq.index, token_ids=[],
                    num_prompt_tokens=seq.num_prompt_tokens, params=seq.params, max_tokens=seq.max_tokens,
                    arrival=seq.arrival)


class SpeculativeDecoder:
    """Decoding with a proposer (`config.method`) and verification by the target model.

    Each step the target scores every verifying sequence's last token and its drafts in one forward pass; the
    target's token after the last token is sampled as usual, draft j is accepted while it equals the target's
    token at its position (sampled with the request's parameters, penalties counting the drafts before it),
    and the target's token after the last accepted draft is taken too. Greedy: exactly greedy decoding. Sampled:
    rejection sampling against one-point drafts, so tokens follow the target distribution (see `Proposer`).
    Logprobs are those of the target's rows, as without speculation. Requests still owing prompt logprobs
    decode one token a step until their prompt is scored.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, runner: Executor, sampler: Sampler,
                 max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.runner = runner
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.num_drafts = 0  # verify steps of a sequence with drafts
        self.num_draft_tokens = 0  # drafts verified so far, and of them accepted
        self.num_accepted_tokens = 0

    def launch(self, batch: ScheduledBatch) -> Launched:
        """target forward (keeping hidden states for a draft head) -> sample -> verify. The engine's commit then
        updates (rejected drafts' KV rolled back, `Scheduler.update_verified`) and calls `propose`."""
        draft_input = None
        if self.proposer.needs_hidden:
            logits, layout, draft_input = self.runner.execute_with_hidden(batch, self.proposer.aux_layers)
        else:
            logits, layout = self.runner.execute(batch)
        sampled = self.sampler.sample(logits, layout, batch.seqs)
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        return Launched(sampled, self.verify(batch, logits, layout, sampled), draft_input, starts)

    def verify(self, batch: ScheduledBatch, logits: torch.Tensor, layout: LogitsLayout,
               sampled: SamplerOutput) -> list[list[int]]:
        """Per seq, the tokens it gains: a verifying seq's accepted drafts (each equal to the target's token
        sampled at its position), then the target's token after the last accepted one. A verifying seq's
        logprobs in `sampled` become a list, one entry per token gained."""
        out = [[] if t is None else [t] for t in sampled.sampled]
        seqs = batch.seqs
        verifying = [i for i, seq in enumerate(seqs) if seq.draft_token_ids]
        if not verifying:
            return out
        mask_drafts = getattr(self.sampler.logits_processor, "mask_drafts", None)
        if mask_drafts is not None:  # constrained seqs: a draft the grammar rejects is rejected below
            mask_drafts(logits, [seqs[i] for i in verifying], [layout.sample_rows[i] for i in verifying])
        row_seqs, rows, before = [], [], []
        for i in verifying:
            drafts = seqs[i].draft_token_ids
            row_seqs += [seqs[i]] * len(drafts)
            rows += range(layout.sample_rows[i] + 1, layout.sample_rows[i] + 1 + len(drafts))
            before += [drafts[:j + 1] for j in range(len(drafts))]  # the drafts the target's row j has seen
        targets = self.sampler.sample_tokens(logits[rows], row_seqs, before)
        want_lp: list[tuple[int, int, int]] = []  # (seq index, draft row, token) of accepted tokens owing logprobs
        k = 0
        for i in verifying:
            drafts = seqs[i].draft_token_ids
            accepted = out[i]
            for d, t in zip(drafts, targets[k:k + len(drafts)]):
                if accepted[-1] != d:
                    break
                accepted.append(t)
            if sampled.logprobs[i] is not None and NONFINITE_TOKEN not in accepted:  # (else failed, unreported)
                sampled.logprobs[i] = [sampled.logprobs[i]]
                want_lp += [(i, k + j, t) for j, t in enumerate(accepted[1:])]
            k += len(drafts)
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += len(accepted) - 1
        if want_lp:  # of the rows as sampled before penalties, bias included (as `Sampler.sample` reports them)
            lp_rows = logits[[rows[r] for _, r, _ in want_lp]]
            apply_logit_bias(lp_rows, [seqs[i] for i, _, _ in want_lp])
            lps = self.sampler.token_logprobs(lp_rows, [t for _, _, t in want_lp],
                                              [seqs[i].params.logprobs for i, _, _ in want_lp])
            for (i, _, _), lp in zip(want_lp, lps, strict=True):
                sampled.logprobs[i].append(lp)
        return out

    def propose(self, batch: ScheduledBatch, launched: Launched) -> None:
        """Drafts for each seq of the step that goes on decoding: at most `config.num_tokens`, and no more than
        its length limits leave room for (the verify step scores the last token and every draft)."""
        wanting, limits = [], []
        k = self.config.num_tokens
        for i, (seq, tokens) in enumerate(zip(batch.seqs, launched.new_tokens, strict=True)):
            if not tokens or seq.finish_reason is not None or seq.needs_prompt_logprobs():
                continue
            limit = min(k, self.max_model_len - seq.num_tokens, seq.max_tokens - seq.num_output_tokens - 1)
            if limit > 0:
                wanting.append(i)
                limits.append(limit)
        drafts = self.proposer.propose(batch, launched, wanting, limits)
        for i, limit, d in zip(wanting, limits, drafts, strict=True):
            assert len(d) <= limit, f"seq {batch.seqs[i].seq_id}: {len(d)} drafts, at most {limit} allowed"
            batch.seqs[i].draft_token_ids = list(d)

    def stats(self) -> dict[str, float]:
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": drafted,
                "spec_num_accepted_tokens": accepted, "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_mean_acceptance_length": 1 + accepted / self.num_drafts if self.num_drafts else 0.0}


def _proposer_class(config: SpeculativeConfig) -> Any:
    module, name = PROPOSERS.get(config.method, HEAD_PROPOSER).split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def speculator_pool_share(config: SpeculativeConfig | None, artifact: LoadedArtifact) -> PoolShare:
    """What `make_speculator(config, ...)`'s proposer will take beside the target's KV pool (none: off)."""
    return PoolShare() if config is None else _proposer_class(config).pool_share(config, artifact)


def make_speculator(config: SpeculativeConfig | None, runner: Executor, sampler: Sampler,
                    artifact: LoadedArtifact) -> SpeculativeDecoder | None:
    """The decoder of `config` (None: speculation off), its proposer from `PROPOSERS` (a draft head: mtp.py)."""
    if config is None:
        return None
    proposer = _proposer_class(config)(config, runner, artifact)
    return SpeculativeDecoder(config, proposer, runner, sampler, artifact.model_config.max_model_len)
