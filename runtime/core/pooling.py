"""Embedding artifacts (manifest `task: embed`): prefill-only requests whose pooled hidden state is the result.

The model returns fp32 final-normed hidden states at the rows the runner asks for (passes/embed_output.py):
the last prompt token's (the sample row) and, for mean pooling, every prompt row (`ModelRunner.all_rows`,
the layout's prompt rows, chunk by chunk). A request ends when its prompt is computed: its delta carries the
embedding (normalized where the checkpoint's sentence-transformers config says) and no token.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ..ipc.protocol import SeqDelta
from ..worker.executor import apply_swaps

logger = logging.getLogger(__name__)


def overrides(manifest: dict[str, Any], sched: Any, speculative: Any, async_scheduling: Any) -> tuple:
    """An embedding artifact's scheduler (no prefix reuse: mean pooling reads every row), no speculation, no
    async scheduling; a generation artifact's unchanged."""
    if manifest.get("task") != "embed":
        return sched, speculative, async_scheduling
    return replace(sched, prefix_cache=None), None, False


def make_pooler(core: Any) -> Pooler | None:
    manifest = core.artifact.manifest
    return Pooler(core, manifest["embedding"]) if manifest.get("task") == "embed" else None


class Pooler:
    """Per-request pooling state and the embedding step of an EngineCore serving an embedding artifact."""

    def __init__(self, core: Any, section: dict[str, Any]) -> None:
        self.core = core
        self.pooling = section["pooling"]
        self.normalize = bool(section["normalize"])
        self.sums: dict[int, torch.Tensor] = {}  # seq id -> sum of its rows so far (mean pooling)
        core.runner.all_rows = self.pooling == "mean"

    def step(self) -> list[SeqDelta]:
        """One prefill step of the queued requests; the deltas of those whose prompt it finished."""
        core = self.core
        batch = core.scheduler.schedule()
        if batch.is_empty:
            return core._step_empty(batch)
        batch = apply_swaps(core.runner, batch)
        live = {seq.seq_id for request in core.requests.values() for seq in request.seqs}
        self.sums = {k: v for k, v in self.sums.items() if k in live}  # aborted requests' sums dropped
        try:
            hidden, layout = core.runner.execute(batch)
        except Exception as error:  # every request of the step fails with it
            logger.warning("embedding step failed: %s: %s", type(error).__name__, error)
            for request_id in dict.fromkeys(seq.request_id for seq in batch.seqs):
                core.end_request(request_id, "error", f"the engine failed on this request: "
                                 f"{type(error).__name__}: {error}")
            return core.take_pending()
        core.scheduler.update(batch, [None] * len(batch.seqs))  # the chunks computed; nothing sampled
        deltas = core.take_pending()
        for i, seq in enumerate(batch.seqs):
            if self.pooling == "mean":
                first, count, start = layout.prompt_rows[i]
                part = hidden[first:first + count].sum(dim=0)  # a chunk from 0: the first (or recomputed)
                self.sums[seq.seq_id] = part if start == 0 else self.sums[seq.seq_id] + part
            row = layout.sample_rows[i]
            if row is None:
                continue
            if self.pooling == "mean":
                vector = self.sums.pop(seq.seq_id) / seq.num_prompt_tokens
            else:
                vector = hidden[row]
            if self.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            deltas.append(SeqDelta(seq.request_id, seq.index, [], finish_reason="stop",
                                   embedding=vector.tolist()))
            seq.finish_reason = "stop"
            core.scheduler.finish(seq)
            core.requests.pop(seq.request_id, None)
        return deltas
