"""Async scheduling: the bookkeeping of a step launched before the previous one's tokens reached the host.

`step(engine)` schedules and launches step N+1 before step N's sampled tokens are read back, assuming every
sequence step N sampled for goes on (a `PLACEHOLDER_TOKEN` stands for its token; step N+1 takes its input id
from step N's token tensor on the device), then reads step N's tokens back and processes them while step
N+1 runs. A sequence found finished late computed one token too many: it is dropped and its KV freed, so
outputs equal the synchronous engine's for greedy and seeded requests (unseeded ones draw from the shared
generator in another order). A step runs synchronously (after reading back any step in flight) when a
sequence in it has penalties (they count the previous token on the host), logprobs or prompt logprobs (read
back every step), or when speculative decoding is on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..ipc.protocol import SeqDelta
from ..worker.executor import apply_swaps
from .batch import ScheduledBatch
from .sampler import NONFINITE_TOKEN
from .sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from .speculative import Launched

if TYPE_CHECKING:
    from .engine import EngineCore


@dataclass(slots=True)
class InFlight:
    """A step launched but not read back: row `rows[k]` of its sampled `tokens` (on the device; `host` is their
    copy, complete once `ready` fires) belongs to `seqs[k]`, whose token_ids hold a placeholder for it at
    `positions[k]`."""

    seqs: list[Sequence]
    positions: list[int]
    rows: list[int]
    row_of: dict[int, int]  # seq_id -> row, for the next step's device-side input ids
    tokens: torch.Tensor
    host: torch.Tensor
    ready: object | None  # torch.cuda.Event on CUDA


def overlaps(seq: Sequence) -> bool:
    """Whether `seq` may sample on the device without its token read back before the next step."""
    p = seq.params
    return not p.has_penalties and p.logprobs is None and not seq.needs_prompt_logprobs()


def step(engine: EngineCore) -> list[SeqDelta]:
    """schedule N+1 (step N's sequences assumed one token longer) -> launch N+1 (input ids of step N's sequences
    gathered on the device) -> sample N+1 on the device, its tokens copied to the host without a sync -> read
    back and process step N -> advance N+1's sequences by a placeholder each. A step that cannot overlap
    samples and is processed at once, after step N."""
    prev, engine._inflight = engine._inflight, None
    scheduler, runner, sampler = engine.scheduler, engine.runner, engine.sampler
    batch = scheduler.schedule()
    if batch.is_empty:
        if prev is not None:  # what is not scheduled may be finishing in the step in flight
            runner.swap(batch)
            return finish(engine, prev)
        return engine._step_empty(batch)
    overlap = engine.async_scheduling and engine.speculator is None and all(map(overlaps, batch.seqs))
    batch = apply_swaps(engine.runner, batch)
    if prev is None and not overlap:
        return engine._step_sync(batch)
    patch = input_patch(batch, prev)
    try:
        logits, layout = runner.execute(batch) if patch is None else runner.execute(batch, patch)
        if overlap:
            tokens, marked = sampler.sample_on_device(logits, layout, batch.seqs)
            host, ready = copy_to_host(marked)
    except Exception:  # not launched: read step N back, then run this one synchronously
        deltas = finish(engine, prev) if prev is not None else engine.take_pending()
        return deltas + engine._step_sync(batch.subset(batch.live()))
    deltas = finish(engine, prev) if prev is not None else engine.take_pending()
    # Sequences finished late (or aborted, or failed) are left out: their extra token is dropped.
    live = batch.live()
    live_batch = batch.subset(live)
    if overlap:
        rows = [layout.sample_rows[i] for i in live]
        grown = scheduler.update(live_batch, [None if r is None else PLACEHOLDER_TOKEN for r in rows])
        rows = [r for r in rows if r is not None]  # update returns the sampled seqs in batch order
        engine._inflight = InFlight(seqs=grown, positions=[len(s.token_ids) - 1 for s in grown], rows=rows,
                                    row_of=dict(zip([s.seq_id for s in grown], rows, strict=True)),
                                    tokens=tokens, host=host, ready=ready)
        return deltas
    try:
        sampled = sampler.sample(logits, layout, batch.seqs)
    except Exception as error:
        return deltas + engine._isolate(live_batch, error)
    return deltas + engine._commit(live_batch, Launched(sampled.subset(live)))


def input_patch(batch: ScheduledBatch, prev: InFlight | None) -> tuple[list[int], list[int], torch.Tensor] | None:
    """(input rows, rows of step N's tokens, those tokens): the input ids of the batch's sequences whose last
    token is still on the device. Only decodes can have one (a preempted sequence is readmitted only after its
    step was read back)."""
    if prev is None:
        return None
    dst, src = [], []
    for i, seq in enumerate(batch.seqs):
        if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            assert i < batch.num_decodes, f"seq {seq.seq_id}: a prefill chunk reads a token still in flight"
            dst.append(i)
            src.append(prev.row_of[seq.seq_id])
    return (dst, src, prev.tokens) if dst else None


def finish(engine: EngineCore, prev: InFlight) -> list[SeqDelta]:
    """Reads step N's tokens back (waiting for that step only), puts them in place of the placeholders and
    processes them as the synchronous step would have."""
    if prev.ready is not None:
        prev.ready.synchronize()
    values = prev.host.tolist()
    grown = []
    finished = SequenceStatus.FINISHED
    for seq, pos, row in zip(prev.seqs, prev.positions, prev.rows, strict=True):
        if seq.status is finished:  # aborted meanwhile (abort_request dropped the placeholder)
            continue
        token_ids = seq.token_ids
        assert pos == len(token_ids) - 1 and token_ids[pos] == PLACEHOLDER_TOKEN, \
            f"seq {seq.seq_id}: no placeholder at {pos}"
        token = values[row]
        if token == NONFINITE_TOKEN:
            engine._fail_nonfinite(seq.request_id)
            continue
        token_ids[pos] = token
        grown.append(seq)
    return engine.take_pending() + engine._deltas(grown)


def copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """A host copy of `tokens` that does not wait for the device: pinned memory filled by an async copy, and
    the event that marks it complete. On CPU the tensor is its own copy."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
