"""The `eagle` proposer: an EAGLE draft head drafting k tokens a step, EAGLE-1/2 (here) or EAGLE-3 (eagle3.py),
told apart by the checkpoint (`is_eagle3`).

An EAGLE-1/2 head (SafeAILab's published layout) is one Llama decoder layer after a projection `fc` of
[embedding(token t+1); target feature at t] (the target's last hidden state after its final norm) to a feature at
t+1; the target's LM head turns a feature into draft logits. It shares the target's embedding and LM head. Either
head keeps the KV of its one layer itself, paged (its own block pool, a block table per sequence); drafts 2..k
chain the head on its own output hidden state and the previous draft. The head runs by the target's kernel
library (its model.py's `K`), batched over every sequence of a step: one varlen forward over the step's tokens,
then one decode forward per chained draft.

`read_checkpoint` checks an EAGLE-1/2 checkpoint directory (config.json and fc.weight / layers.0.* in
model.safetensors or pytorch_model.bin), eagle3.py's `read_eagle3_checkpoint` an EAGLE-3 one; `kiln compile` runs
them for `speculative { method = eagle; draft = "hf:DIR" }` before storing the head in the artifact's eagle/
(EAGLE_DIR).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ...config import SpeculativeConfig
from ...errors import ArtifactError
from ...forward_batch import ForwardBatch
from ...worker.interface import host_to_device
from ..batch import ScheduledBatch, cdiv
from ..kv_cache import BlockManager
from ..sequence import Sequence
from . import Launched, PoolShare, Proposer, SeqStates, draft_path, shadow_sequence
from .eagle_head import (
    EagleHead,
    head_numel,
    head_shape,
    is_eagle3,
    read_checkpoint,
    target_kernels,
    target_tensor,
    weight_shapes,
)


@dataclass(slots=True)
class _HeadKV:
    """One sequence's rows in the head's paged pool: the K/V of its positions `first`, `first` + 1, ... (those
    of the target's computed tokens, then drafts'), in the blocks of `shadow.block_table` (the head's
    BlockManager), `shadow.num_computed_tokens` of them being the rows kept across steps."""

    shadow: Sequence
    first: int = 0

    def keep_below(self, position: int) -> None:
        """Drops rows at `position` and after (drafts, rejected or not, and a preempted sequence's); rows would
        start at `position` when none below it are held (a prefix-cache hit, or a recompute from the start)."""
        held = self.shadow.num_computed_tokens
        if self.first <= position <= self.first + held:
            self.shadow.num_computed_tokens = position - self.first
        else:
            self.first, self.shadow.num_computed_tokens = position, 0


class EagleProposer(Proposer):
    """Runs the head (`head`: an EagleHead, or eagle3.py's Eagle3Head, whose target layers the target's forward
    then returns as `aux_layers`) over every token the target computed in the step (its KV must cover each computed
    position, drafting or not), rows past a rejected draft dropped: one varlen forward over every sequence of
    the step; then chains it from each drafting sequence's last valid position `limit` times, greedily: one
    batched decode forward per draft over the sequences still drafting. The head's KV is one paged layer of
    its own (a BlockManager over as many token slots as the target's pool plus k + a block per sequence it may
    run), block tables per sequence. Chained rows' KV is dropped at the next step, which rewrites those
    positions from the target's features. A prefix-cache hit leaves the head without KV for the cached
    positions: its drafts are then worse, never wrong (verification is exact); so does a full head pool (the
    sequence's rows restart at the next step)."""

    needs_hidden = True

    @classmethod
    def pool_share(cls, config: SpeculativeConfig, artifact: Any) -> PoolShare:
        """One KV layer per target token slot, plus k + a block per sequence, and the head's weights (all but what
        it reads from the target: the embedding, and an EAGLE-1/2 head's LM head), in the target's dtype, and an
        EAGLE-3 head's draft-to-target id table (int64): from its config and its weights' shapes, before it is
        loaded. Nothing when they cannot be read (the load will say why)."""
        path = draft_path(config, artifact)
        try:
            s = head_shape(path)
            eagle3 = is_eagle3(path)
            numel = head_numel(path, ("embed", "d2t", "t2d") if eagle3 else ("lm_head", "embed"))
            ids = math.prod(weight_shapes(path).get("d2t", [0])) if eagle3 else 0
            embed = target_tensor(artifact.model, "embed", (artifact.model_config.vocab_size, s.hidden), packed=True)
        except (ValueError, OSError, RuntimeError, ArtifactError):
            return PoolShare()
        size = torch.empty((), dtype=embed.dtype).element_size()
        per_token = 2 * s.kv_heads * s.head_dim * size
        bs = artifact.kv_cache_config.block_size
        seqs = artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        return PoolShare(per_block=bs * per_token, fixed=numel * size + ids * 8 + seqs * per_token)

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        path = draft_path(config, artifact)
        model, mc = artifact.model, artifact.model_config
        self.K = target_kernels(model)
        try:
            if is_eagle3(path):
                from .eagle3 import load_eagle3_head

                self.head = load_eagle3_head(path, artifact, self.K)
            else:
                shape, weights = read_checkpoint(path)
                kiln_file = path / "kiln.json"  # written by kiln compile; a raw checkpoint: its own eps (the target's)
                extra = json.loads(kiln_file.read_text(encoding="utf-8")) if kiln_file.is_file() else {}
                self.head = EagleHead(shape, weights, model, self.K, mc.max_model_len,
                                      float(extra.get("target_norm_eps") or shape.eps))
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        shape = self.head.shape
        self.aux_layers = self.head.aux_layers
        self.embed = target_tensor(model, "embed", (mc.vocab_size, shape.hidden), packed=True)  # K.embedding's
        bs = artifact.kv_cache_config.block_size
        tokens = runner.num_blocks * bs + artifact.scheduler_config.max_seqs * (config.num_tokens + bs)
        self.block_manager = BlockManager(cdiv(tokens, bs), bs)
        self.kv_cache = torch.zeros((self.block_manager.num_blocks, 2, bs, shape.kv_heads, shape.head_dim),
                                    dtype=self.embed.dtype, device=artifact.device)
        self.kv: SeqStates[_HeadKV] = SeqStates(lambda seq: _HeadKV(shadow_sequence(seq)),
                                                lambda state: self.block_manager.free(state.shadow))

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        self.kv.prune()
        want = dict(zip(wanting, limits, strict=True))
        rows: list[int] = []  # the step's hidden rows the head reads, sequence after sequence
        tokens: list[int] = []  # token t+1 of each
        entries: list[tuple[_HeadKV, int, int]] = []  # (state, first position, rows) of each sequence it runs
        chains: list[tuple[int, int, _HeadKV]] = []  # (batch index, last row, state) of each drafting sequence
        base = 0
        for i, (seq, n, start) in enumerate(zip(batch.seqs, batch.num_new_tokens, launched.starts, strict=True)):
            count = seq.num_computed_tokens - start  # valid rows: computed, token t+1 known
            lo, base = base, base + n
            if seq.is_finished:
                continue
            state = self.kv.get(seq)
            state.keep_below(start)
            if count <= 0:
                continue
            if not self.block_manager.allocate_slots(state.shadow, count + want.get(i, 1) - 1):
                self.block_manager.free(state.shadow)  # a full pool: its rows restart at the next step
                state.first, state.shadow.num_computed_tokens = seq.num_computed_tokens, 0
                continue
            rows.extend(range(lo, lo + count))
            tokens.extend(seq.token_ids[start + 1:start + 1 + count])
            entries.append((state, start, count))
            if i in want:
                chains.append((i, len(rows) - 1, state))
        if not entries:
            return [[] for _ in wanting]
        K, device = self.K, self.kv_cache.device
        with torch.inference_mode():
            fb = self._batch(entries, host_to_device(tokens, torch.int32, device))
            hidden = self.head.start(launched.draft_input, host_to_device(rows, torch.int64, device))
            f = self.head.forward(K.embedding(fb.input_ids, self.embed), hidden, fb, self.kv_cache)
            for state, _, count in entries:
                state.shadow.num_computed_tokens += count
            if not chains:
                return [[] for _ in wanting]
            f = f[host_to_device([r for _, r, _ in chains], torch.int64, device)]
            tok = self.head.draft(f)  # draft 1 of every chain
            live = list(range(len(chains)))
            rounds = [(live, tok)]
            for r in range(1, max(want[i] for i, _, _ in chains)):
                keep = [j for j, c in enumerate(live) if want[chains[c][0]] > r]
                if not keep:
                    break
                if len(keep) < len(live):
                    index = host_to_device(keep, torch.int64, device)
                    f, tok, live = f[index], tok[index], [live[j] for j in keep]
                # draft r + 1: the head at position num_computed + r - 1, on draft r and its own feature
                fb = self._batch([(chains[c][2], batch.seqs[chains[c][0]].num_computed_tokens + r - 1, 1)
                                  for c in live], tok.to(torch.int32), num_decodes=len(live))
                f = self.head.forward(K.embedding(fb.input_ids, self.embed), f, fb, self.kv_cache)
                tok = self.head.draft(f)
                rounds.append((live, tok))
            flat = iter(torch.cat([t for _, t in rounds]).tolist())  # the one copy of the drafts to the host
        drafts: dict[int, list[int]] = {}
        for live, _ in rounds:
            for c in live:
                drafts.setdefault(chains[c][0], []).append(next(flat))
        return [drafts.get(i, []) for i in wanting]

    def _batch(self, entries: list[tuple[_HeadKV, int, int]], input_ids: torch.Tensor,
               num_decodes: int = 0) -> ForwardBatch:
        """The head's ForwardBatch of `entries` (state, position p, count): each sequence's rows at positions
        p, p + 1, ... after the rows its state holds below p; rotary positions in the sequence, slots and context
        in the head's pool."""
        bs = self.block_manager.block_size
        positions: list[int] = []
        slots: list[int] = []
        starts, lens = [0], []
        for state, start, count in entries:
            table, lo = state.shadow.block_table, start - state.first
            positions.extend(range(start, start + count))
            slots.extend(table[p // bs] * bs + p % bs for p in range(lo, lo + count))
            starts.append(starts[-1] + count)
            lens.append(lo + count)
        width = cdiv(max(lens), bs)
        tables = [state.shadow.block_table[:cdiv(n, bs)] + [-1] * (width - cdiv(n, bs))
                  for (state, _, _), n in zip(entries, lens, strict=True)]
        device = self.kv_cache.device

        def i32(values: list) -> torch.Tensor:
            return host_to_device(values, torch.int32, device)

        return ForwardBatch(input_ids=input_ids, positions=i32(positions), query_start_loc=i32(starts),
                            seq_lens=i32(lens), block_tables=i32(tables),
                            slot_mapping=host_to_device(slots, torch.int64, device), logits_indices=i32([]),
                            num_decodes=num_decodes)
