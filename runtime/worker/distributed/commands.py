"""The step commands rank 0 sends the other ranks, as one int64 tensor (no pickle), and what a rank does with one.

    [cmd, n_ints, *ints, n_batches, *batch_0, *batch_1, ...]
    batch = [B, T, max_blocks, L, num_decodes, dp_ranks, input_ids(T), positions(T), query_start_loc(B+1),
             seq_lens(B), block_tables(B*max_blocks), slot_mapping(T), logits_indices(L),
             dp_num_tokens(dp_ranks), dp_num_rows(dp_ranks)]

One batch: every rank runs it (tensor-parallel attention). One per rank: rank r runs batch r (data-parallel
attention), each carrying every rank's token and logits-row counts. A step with LoRA adapters carries, after
EXECUTE's two ints, each sequence's adapter id and the slot rank 0 chose for each adapter (`lora_step_ints`);
LORA loads or unloads an adapter on every rank between steps (`lora_command_ints`). KV_OFFLOAD copies blocks of
the CPU offload tier between each rank's KV pool and its host slots (worker/distributed/kv_offload.py).

Commands travel only between the mesh's ranks (a broadcast of the gloo control group; an outsider reaches at
most the rendezvous store). A command that does not decode is CommandError (a CommError): the worker exits
(worker_loop) rather than guess which collectives the step joins, and rank 0's executor fails the mesh with
that exit at once, not at the collectives' timeout.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...core.batch import ScheduledBatch
from ..interface import DraftInput, HostBatch
from ..lora import LoRAError, LoRAManager, lora_manager
from ..model_runner import ModelRunner
from .comm import CommError

logger = logging.getLogger(__name__)


class Cmd(enum.IntEnum):
    STOP = 0
    ALLOCATE = 1  # ints: num_blocks, num_swap_blocks
    EXECUTE = 2  # ints: keep_hidden, logit_candidates (ForwardBatch's); batches
    PROPOSE = 3  # ints: draft method index, n, input_ids(n), rows...
    SWAP = 4  # ints: n_out, (device, cpu) * n_out, n_in, (cpu, device) * n_in
    PROFILE = 5  # ints: prefill lengths
    LORA = 6  # ints: op (LORA_LOAD / LORA_UNLOAD), lora_id, len(name), name (utf-8), len(path), path (utf-8)
    KV_OFFLOAD = 7  # ints: the offload tier's host copies (worker/distributed/kv_offload.py: allocate_ints, copy_ints)


LORA_LOAD, LORA_UNLOAD = 0, 1


def text_ints(text: str) -> list[int]:
    data = text.encode("utf-8")
    return [len(data), *data]


def _ints_text(ints: list[int], k: int) -> tuple[str, int]:
    n = ints[k]
    return bytes(ints[k + 1:k + 1 + n]).decode("utf-8"), k + 1 + n


def lora_command_ints(op: int, lora_id: int, name: str = "", path: str = "") -> list[int]:
    """A LORA command's ints: load (name, path) or unload the adapter rank 0 gave id `lora_id`."""
    return [op, lora_id, *text_ints(name), *text_ints(path)]


def lora_step_ints(lora_ids: list[int | None], slots: dict[int, int]) -> list[int]:
    """An EXECUTE command's adapter part: each sequence's adapter id (-1: the base model) and the slot rank 0
    chose for each adapter of the step; empty when no sequence has one."""
    if not slots:
        return []
    out = [len(lora_ids), *(-1 if i is None else i for i in lora_ids), len(slots)]
    for lora_id, slot in slots.items():
        out += [lora_id, slot]
    return out


def _lora_step(ints: list[int]) -> tuple[list[int | None], dict[int, int]]:
    if not ints:
        return [], {}
    n = ints[0]
    ids = [None if i < 0 else i for i in ints[1:1 + n]]
    m = ints[1 + n]
    pairs = ints[2 + n:2 + n + 2 * m]
    return ids, {pairs[2 * j]: pairs[2 * j + 1] for j in range(m)}


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


class CommandError(CommError):
    """A step command that does not decode: this rank cannot know which collectives the step joins, so the mesh
    cannot run another step (a worker exits, and rank 0's executor fails with it)."""


def decode(t: torch.Tensor) -> tuple[Cmd, list[int], list[HostBatch]]:
    """The command `encode` made; CommandError for anything else (an unknown command, a count that is negative
    or runs past the end, ints left over), never a partly read one."""
    v = t.tolist()
    k = 0

    def take(m: int) -> list[int]:
        nonlocal k
        if m < 0 or k + m > len(v):
            raise CommandError(f"a malformed step command ({len(v)} ints): {m} ints wanted at {k}")
        k += m
        return v[k - m:k]

    head, = take(1)
    try:
        cmd = Cmd(head)
    except ValueError:
        raise CommandError(f"a malformed step command ({len(v)} ints): unknown command {head}") from None
    ints = take(take(1)[0])
    batches = []
    num_batches, = take(1)
    if num_batches < 0:
        raise CommandError(f"a malformed step command ({len(v)} ints): {num_batches} batches")
    for _ in range(num_batches):
        num_seqs, tokens, width, rows, num_decodes, dp = take(6)

        input_ids, positions = take(tokens), take(tokens)
        qsl, seq_lens = take(num_seqs + 1), take(num_seqs)
        tables = [take(width) for _ in range(num_seqs)]
        slots, logits_indices = take(tokens), take(rows)
        dp_tokens, dp_rows = take(dp), take(dp)
        batches.append(HostBatch(input_ids, positions, qsl, seq_lens, tables, slots, logits_indices, num_decodes,
                                 dp_tokens or None, dp_rows or None))
    if k != len(v):
        raise CommandError(f"a malformed step command ({len(v)} ints): {len(v) - k} ints past its end")
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
    # the rank's adapter slots (lora.LoRAManager of its slices); rank 0's is the engine's, set by its executor
    lora: LoRAManager | None = None
    host_kv: Any = None  # kv_offload.HostKV: the rank's slices of the offload tier's host blocks (KV_OFFLOAD)

    def __post_init__(self) -> None:
        art = self.artifact
        art.model.comm = self.comm
        self.methods = sorted((art.manifest.get("drafts") or {}).values(), key=lambda d: d["method"])
        if self.comm.rank > 0 and self.lora is None:
            self.lora = lora_manager(art.manifest, art.path, art.device, rank=self.comm.rank)

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
            if len(ints) > 2:  # adapters in the step: paged into the slots rank 0 chose
                self._attach_lora(fb, host, *_lora_step(ints[2:]))
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
        if cmd is Cmd.LORA:
            return self._lora_command(ints)
        if cmd is Cmd.KV_OFFLOAD:
            from .kv_offload import offload_command

            return offload_command(self, ints)
        raise AssertionError(f"unknown command {cmd!r}")

    def _attach_lora(self, fb: Any, host: HostBatch, lora_ids: list[int | None], slots: dict[int, int]) -> None:
        starts = host.query_start_loc
        token_adapters = [(i, starts[k], starts[k + 1] - starts[k]) for k, i in enumerate(lora_ids)]
        fb.lora = self.lora.batch(slots, token_adapters, len(host.input_ids))
        fb.lora_ids = torch.tensor([-1 if i is None else slots[i] for i in lora_ids], dtype=torch.int32,
                                   device=self.artifact.device)

    def _lora_command(self, ints: list[int]) -> int | None:
        """Loads (every rank reads its own slice of the adapter's files) or unloads an adapter by rank 0's id.
        A load ends with every rank agreeing: the number of ranks that could not read it is summed over the
        mesh and returned; where it is not 0 every rank drops the adapter again (rank 0's manager undoes its
        own load when its executor sees the count)."""
        op, lora_id = ints[0], ints[1]
        if op == LORA_UNLOAD:
            if self.comm.rank > 0:
                self.lora.unload_id(lora_id)
            return None
        failed = 0
        if self.comm.rank > 0:  # rank 0 read it already (LoRAManager.load, which told its executor)
            try:  # texts that do not decode fail the load here, and this rank still joins the count below
                name, k = _ints_text(ints, 2)
                path, _ = _ints_text(ints, k)
                self.lora.load(name, path, lora_id=lora_id)
            except (LoRAError, OSError, ValueError, IndexError) as e:
                logger.warning("rank %d: cannot load LoRA adapter %d: %s", self.comm.rank, lora_id, e)
                failed = 1
        flag = torch.tensor([float(failed)], device=self.artifact.device)
        total = int(self.comm.all_reduce(flag).item())
        if total and not failed and self.comm.rank > 0:
            self.lora.unload_id(lora_id)
        return total


def profile_forward(art: Any, lengths: list[int]) -> int:
    """The activation peak of one prefill of `lengths` on this rank (CUDA), its collectives joined with the others'."""
    from ..memory_plan import profile_activation_peak

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


__all__ = ["LORA_LOAD", "LORA_UNLOAD", "Cmd", "CommandError", "RankState", "decode", "empty_batch", "encode", "lora_command_ints",
           "lora_step_ints", "swap_ints"]


def profile_model(art: Any) -> Any:
    """The model a rank profiles: data-parallel attention gives every rank the whole profile prefill (as if each
    had that many tokens: an upper bound on the MLPs' gathered rows)."""
    if (art.manifest.get("parallel") or {}).get("attention") != "dp":
        return art.model
    world = int(art.manifest["parallel"]["world_size"])

    class _EveryRank:
        def forward(self, fb, caches):
            fb.dp_num_tokens = [fb.num_tokens] * world
            fb.dp_num_rows = [int(fb.logits_indices.shape[0])] * world
            return art.model.forward(fb, caches)

    return _EveryRank()
