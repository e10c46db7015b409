"""One step's data as the engine core hands it to the worker: the scheduled sequences (`ScheduledBatch`) and,
coming back, which logits rows are whose (`LogitsLayout`); the little arithmetic both sides share. The worker
reads the core through this module and core/sequence.py only (tests/runtime/test_layers.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence, SequenceStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)



@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `seqs[i]` runs its next `num_new_tokens[i]` tokens. The first `num_decodes` are
    decodes (one token each), the rest prefill chunks (which may start past a cached prefix)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    # KV block copies the runner performs before the forward pass: (device block, cpu block) to swap out,
    # (cpu block, device block) to swap in. A step never does both (see Scheduler.schedule).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def live(self) -> list[int]:
        """The indices of the sequences that did not finish meanwhile (late, aborted or failed)."""
        return [i for i, seq in enumerate(self.seqs) if seq.status is not SequenceStatus.FINISHED]

    def subset(self, indices: list[int]) -> ScheduledBatch:
        """The sequences `indices` (ascending), decodes still first; no swaps (this batch did them)."""
        if len(indices) == len(self.seqs):
            return self
        return ScheduledBatch(seqs=[self.seqs[i] for i in indices],
                              num_new_tokens=[self.num_new_tokens[i] for i in indices],
                              num_decodes=sum(1 for i in indices if i < self.num_decodes))


@dataclass(slots=True)
class LogitsLayout:
    """Which logits rows belong to which sequence of the batch (indices parallel to `ScheduledBatch.seqs`).

    `sample_rows[i]` is the row to sample seq i's next token from (None: mid-prefill chunk).
    `prompt_rows[i]` = (first row, count, first position): rows for prompt positions p..p+count-1, whose
    log-softmax scores the prompt tokens p+1..p+count (None when no prompt logprobs are due this step).
    A seq verifying k draft tokens has k + 1 consecutive rows from `sample_rows[i]`: the target model's token
    after its last token, then after each draft.
    """

    sample_rows: list[int | None]
    prompt_rows: list[tuple[int, int, int] | None]



def logit_candidates(seqs: list[Sequence], layout: LogitsLayout) -> int:
    """How many of each row's largest logits the sampler reads for this step (0: every logit): 1 when every row is
    greedy, the largest top_k when every row is greedy or top-k; 0 when a row needs the whole distribution (its
    logprobs or prompt logprobs, penalties, a logit bias, a grammar or thinking budget, sampling without top-k).
    Given only those k (the others -inf), `sample` picks the same tokens from the same noise: the max is the max,
    and top-k, top-p and min-p act inside the same k."""
    if any(rows is not None for rows in layout.prompt_rows):
        return 0
    k = 1
    for seq, row in zip(seqs, layout.sample_rows, strict=True):
        if row is None:
            continue
        p = seq.params
        if (p.logprobs is not None or p.has_penalties or p.logit_bias or p.structured_output is not None
                or p.thinking is not None):
            return 0
        if not p.greedy:
            if p.top_k <= 0:
                return 0
            k = max(k, p.top_k)
    return k
