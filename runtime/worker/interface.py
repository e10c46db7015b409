"""The contract between the engine core and whatever runs the model: the `Executor` the core calls each step,
the error it raises when it cannot run another (`ExecutorError`), and the step data a runner hands back
(`HostBatch`, `DraftInput`). The core's side of the step data (ScheduledBatch, LogitsLayout) is core/batch.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..core.batch import LogitsLayout, ScheduledBatch
from ..errors import KilnRuntimeError
from ..forward_batch import ForwardBatch


class ExecutorError(KilnRuntimeError):
    """The executor cannot run another step: a rank died, or hung past its timeout. Not any request's fault: the
    engine fails every request in flight with it, and a server stops (exit status non-zero)."""


class Executor(Protocol):
    """What the engine calls each step. Contract: `execute` writes the step's K/V into the KV pool it owns and
    returns float32 logits [rows, vocab] (exactly the vocabulary: padded columns never leave) with the layout of
    which rows are whose; nothing else changes. A mesh executor raises ExecutorError once it cannot run steps
    (then every later call raises it at once)."""

    num_blocks: int  # KV blocks of the pool (the BlockManager hands out ids [0, num_blocks))
    num_swap_blocks: int  # CPU blocks for preemption by swap
    memory_plan: dict[str, Any]  # how the pool was sized (model_runner.plan_memory)
    graph_runner: Any  # CUDA-graph replay, or None

    def execute(self, batch: ScheduledBatch, input_patch: tuple[list[int], list[int], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, LogitsLayout]: ...

    def execute_with_hidden(self, batch: ScheduledBatch, aux_layers: tuple[int, ...] = ()
                            ) -> tuple[torch.Tensor, LogitsLayout, DraftInput]: ...

    def propose(self, method: str, draft: DraftInput, input_ids: list[int], rows: list[int]) -> list[int]: ...

    def swap(self, batch: ScheduledBatch) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class HostBatch:
    """A ForwardBatch's contents as host lists (`ModelRunner.plan`), before they are copied to the device.
    `block_tables` rows are padded with -1 to one width. Data-parallel attention: the ranks' token and logits
    row counts of the whole step (every rank's sub-batch carries them)."""

    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    logits_indices: list[int]
    num_decodes: int
    dp_num_tokens: list[int] | None = None
    dp_num_rows: list[int] | None = None


@dataclass(slots=True)
class DraftInput:
    """What a draft head reads after the target model's step: its batch (positions, slots, block tables) and
    the hidden states the forward returned for every token: the last ones (`hidden`), or those entering the
    decoder layers the head asked for (`aux`, an EAGLE-3 head's, each [T, hidden], in the order asked)."""

    batch: ForwardBatch
    hidden: torch.Tensor | None
    aux: list[torch.Tensor] | None = None


def host_to_device(values: list, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: a blocking host-to-device copy
    synchronizes the stream, which would stall async scheduling behind the step in flight. The pinned
    staging buffer is reused only after the copy ran (torch's host allocator records it on the stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
