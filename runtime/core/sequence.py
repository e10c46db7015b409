"""Sequence: one completion being generated, and the state every runtime layer reads or advances."""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..outputs import FinishReason
from ..sampling_params import SamplingParams

# Async scheduling: stands in `token_ids` for a token sampled by a step still running on the device (the
# engine writes the real one when it reads that step back). Never a real id, so a slip shows as a bad index.
PLACEHOLDER_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no KV blocks
    RUNNING = "running"  # holds KV blocks for its first `num_computed_tokens` tokens
    SWAPPED = "swapped"  # preempted by swap: its computed tokens' K/V wait in CPU blocks `cpu_blocks`
    REMOTE = "remote"  # its prompt's K/V is being prefilled elsewhere (runtime/disagg): in no queue, no blocks
    PENDING = "pending"  # not queued yet: its grammar is compiling (constrained.py)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """`token_ids` = prompt + generated tokens. Tokens `[0, num_computed_tokens)` have their K/V in the blocks
    of `block_table`; a decoding sequence has exactly one uncomputed token (the last one sampled).

    Mutated by: the scheduler (status, num_computed_tokens, block_table through the block manager), the
    engine core (token_ids, finish). Text, stop strings and logprobs are the front-end's (OutputProcessor). Preemption by recompute resets num_computed_tokens to 0;
    preemption by swap keeps it and moves the blocks' contents to `cpu_blocks`.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # params.max_tokens, resolved against max_model_len
    arrival: int  # monotonic admission order: FCFS key, and preemption picks the largest
    generator: torch.Generator | None = None
    want_prompt_logprobs: bool = False
    priority: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)  # swap space holding the KV of a SWAPPED sequence
    block_hashes: list[bytes] = field(default_factory=list)  # key chain of the full blocks (block_hash.py)
    num_registered_blocks: int = 0  # leading blocks of block_table already published to the prefix cache
    # prompt positions whose logprobs were computed (position 0 has none, so it counts from 1); survives
    # preemption, so a recomputed prompt does not report them twice
    num_prompt_logprobs: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it (None: eos, length, abort, error)
    # speculative decoding: tokens a draft head proposed after the last one; the next step verifies them with
    # the target model. Not part of token_ids until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    # multi-LoRA: the id of the loaded adapter this completion decodes with (lora.LoRAManager; None: the base
    # model). Unique per load, so it also keys the prefix cache: another adapter's K/V is never reused.
    lora_id: int | None = None
    # KV reservation (scheduler `kv_reserve`): the blocks this sequence may grow to (prompt + max_tokens), held
    # for it from admission on, so it is never preempted; the ones not yet in `block_table` count in the block
    # manager's `num_reserved`. 0: none (admitted optimistically, preemptible).
    num_reserved_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_computed_tokens > 0 and self.num_uncomputed_tokens == 1 \
            and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def needs_prompt_logprobs(self) -> bool:
        """True until logprobs for every prompt position have been collected (survives preemption)."""
        return self.want_prompt_logprobs and self.num_prompt_logprobs < self.num_prompt_tokens


@dataclass(slots=True, eq=False)
class Request:
    """One request in the engine core: its prompt and its `params.n` sequences (completions)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @classmethod
    def new(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
            seq_ids: Iterator[int], arrivals: Iterator[int], priority: int, device: torch.device,
            lora_id: int | None = None) -> Request:
        """The request's fresh sequences: ids and admission order from the engine's counters; a seeded request's
        completion i samples from a generator seeded `seed + i`; all decode with the LoRA adapter `lora_id`
        (None: the base model)."""
        ids = [int(t) for t in prompt_token_ids]
        max_tokens = params.max_tokens or max_model_len - len(ids)
        seqs = []
        for i in range(params.n):
            seq = Sequence(seq_id=next(seq_ids), request_id=request_id, index=i, token_ids=list(ids),
                           num_prompt_tokens=len(ids), params=params, max_tokens=max_tokens, arrival=next(arrivals),
                           priority=priority, want_prompt_logprobs=params.prompt_logprobs is not None and i == 0)
            seq.num_prompt_logprobs = int(seq.want_prompt_logprobs)  # position 0 has none
            seq.lora_id = lora_id
            if params.seed is not None:
                seq.generator = torch.Generator(device=device).manual_seed(params.seed + i)
            seqs.append(seq)
        return cls(request_id, ids, params, seqs)
