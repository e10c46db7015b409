"""The step commands rank 0 sends the other ranks, as one int64 tensor (no pickle), and what a rank does with one.

    [cmd, n_ints, *ints, n_batches, *batch_0, *batch_1, ...]
    batch = [B, T, max_blocks, L, num_decodes, dp_ranks, input_ids(T), positions(T), query_start_loc(B+1),
             seq_lens(B), block_tables(B*max_blocks), slot_mapping(T), logits_indices(L),
             dp_num_tokens(dp_ranks), dp_num_rows(dp_ranks)]

One batch: every rank runs it (tensor-parallel attention). One per rank: rank r runs batch r (data-parallel
attention), each carrying every rank's token and logits-row counts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..model_runner import DraftInput, HostBatch, ModelRunner
from ..scheduler import ScheduledBatch


class Cmd(enum.IntEnum):
    STOP = 0
    ALLOCATE = 1  # ints: num_blocks, num_swap_blocks
    EXECUTE = 2  # ints: keep_hidden, logit_candidates (ForwardBatch's); batches
    PROPOSE = 3  # ints: draft method index, n, input_ids(n), rows...
    SWAP = 4  # ints: n_out, (device, cpu) * n_out, n_in, (cpu, device) * n_in
    PROFILE = 5  # ints: prefill lengths


def _batch_ints(h: HostBatch) -> list[int]:
    num_seqs, width = len(h.seq_lens), (len(h.block_tables[0]) if h.block_tables else 0)
    dp = h.dp_num_tokens or []
    out = [num_seqs, len(h.input_ids), width, len(h.logits_indices), h.num_decodes, len(dp)]
    out += h.input_ids + h.positions + h.query_start_loc + h.seq_lens
    for row in h.block_tables:
        out += row
    out += h.slot_mapping + h.logits_indices + dp + (h.dp_num_rows or [])
    return out


def encode(cmd: Cmd, ints: list[int] = (), batches: list[HostBatch] = ()) -> torch.Tensor:
    out = [int(cmd), len(ints), *ints, len(batches)]
    for b in batches:
        out += _batch_ints(b)
    return torch.tensor(out, dtype=torch.int64)


def decode(t: torch.Tensor) -> tuple[Cmd, list[int], list[HostBatch]]:
    v = t.tolist()
    cmd, n = Cmd(v[0]), v[1]
    ints, k = v[2:2 + n], 2 + n
    batches = []
    num_batches = v[k]
    k += 1
    for _ in range(num_batches):
        num_seqs, tokens, width, rows, num_decodes, dp = v[k:k + 6]
        k += 6

        def take(m: int) -> list[int]:
            nonlocal k
            k += m
            return v[k - m:k]

        input_ids, positions = take(tokens), take(tokens)
        qsl, seq_lens = take(num_seqs + 1), take(num_seqs)
        tables = [take(width) for _ in range(num_seqs)]
        slots, logits_indices = take(tokens), take(rows)
        dp_tokens, dp_rows = take(dp), take(dp)
        batches.append(HostBatch(input_ids, positions, qsl, seq_lens, tables, slots, logits_indices, num_decodes,
                                 dp_tokens or None, dp_rows or None))
    return cmd, ints, batches


def empty_batch(dp_num_tokens: list[int], dp_num_rows: list[int]) -> HostBatch:
    """A rank's batch in a step that gave it no sequence (data-parallel attention): it still joins the MLPs'
    collectives, with no rows of its own."""
    return HostBatch([], [], [0], [], [], [], [], 0, dp_num_tokens, dp_num_rows)


@dataclass
class RankState:
    """One rank's part of the mesh: its model (its shards, bound to its communicator), its KV pool and the draft
    head's inputs of the last step. `handle` runs a command; every rank runs the same commands in the same order,
    so their collectives pair up."""

    artifact: Any  # the rank's LoadedArtifact
    comm: Any
    runner: ModelRunner | None = None
    draft: DraftInput | None = None

    def __post_init__(self) -> None:
        self.artifact.model.comm = self.comm
        self.methods = sorted((self.artifact.manifest.get("drafts") or {}).values(), key=lambda d: d["method"])

    @property
    def model(self) -> Any:
        return self.artifact.model

    def handle(self, cmd: Cmd, ints: list[int], batches: list[HostBatch]) -> Any:
        art = self.artifact
        if cmd is Cmd.ALLOCATE:
            self.runner = ModelRunner(art.model, art.kv_cache_config, ints[0], art.device, ints[1], None)
            return None
        runner = self.runner
        if cmd is Cmd.EXECUTE:
            host = batches[self.comm.rank] if len(batches) > 1 else batches[0]
            fb = runner.forward_batch(host)
            fb.logit_candidates = ints[1]
            if ints[0]:  # keep what the draft head reads next
                with torch.inference_mode():
                    logits, hidden = art.model.forward(fb, runner.kv_caches, return_hidden=True)
                self.draft = DraftInput(fb, hidden)
                return logits.float()
            with torch.inference_mode():
                return runner.run(fb)
        if cmd is Cmd.PROPOSE:
            method, n = self.methods[ints[0]]["method"], ints[1]
            input_ids, rows = ints[2:2 + n], ints[2 + n:]
            fb = replace(self.draft.batch,
                         input_ids=torch.tensor(input_ids, dtype=torch.int32, device=art.device),
                         logits_indices=torch.tensor(rows, dtype=torch.int32, device=art.device))
            with torch.inference_mode():
                out = getattr(art.model, method)(fb, self.draft.hidden, runner.kv_caches)
            return out[0] if isinstance(out, tuple) else out  # a chaining head's hidden state: unused here (k = 1)
        if cmd is Cmd.SWAP:
            n_out = ints[0]
            out = [tuple(ints[1 + 2 * j:3 + 2 * j]) for j in range(n_out)]
            rest = ints[1 + 2 * n_out:]
            swap_in = [tuple(rest[1 + 2 * j:3 + 2 * j]) for j in range(rest[0])]
            runner.swap(ScheduledBatch(swap_out=out, swap_in=swap_in))
            return None
        if cmd is Cmd.PROFILE:
            return profile_forward(art, ints)
        raise AssertionError(f"unknown command {cmd!r}")


def profile_forward(art: Any, lengths: list[int]) -> int:
    """The activation peak of one prefill of `lengths` on this rank (CUDA), its collectives joined with the others'."""
    from ..memory_plan import profile_activation_peak
    from .executor import profile_model

    return profile_activation_peak(profile_model(art), art.kv_cache_config, art.device, lengths,
                                   art.model_config.vocab_size)


def swap_ints(batch: ScheduledBatch) -> list[int]:
    out = [len(batch.swap_out)]
    for pair in batch.swap_out:
        out += list(pair)
    out.append(len(batch.swap_in))
    for pair in batch.swap_in:
        out += list(pair)
    return out


__all__ = ["Cmd", "RankState", "decode", "empty_batch", "encode", "swap_ints"]
