"""Model runner: owns the paged KV tensors, turns a ScheduledBatch into a ForwardBatch, runs the model."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config import CUDAGraphConfig, KVCacheConfig
from ..core.batch import LogitsLayout, ScheduledBatch, cdiv
from ..forward_batch import ForwardBatch
from .graph_runner import CUDAGraphRunner
from .interface import DraftInput, HostBatch, host_to_device


class ModelRunner:
    """Allocates `num_layers` KV tensors once, then per step: prepare the ForwardBatch, call `model.forward`.

    The model writes each new token's K/V at `slot_mapping` and reads its context through `block_tables`;
    it returns float32 logits with one row per `logits_indices` entry.

    With `cuda_graphs`, pure-decode steps go through a CUDAGraphRunner: one extra KV block (index
    `num_blocks`, never handed out by the BlockManager) is the scratch block its padding rows write to;
    `capture_graphs=False` keeps its eager "replay" over the padded static buffers (CPU tests).
    """

    def __init__(self, model: Any, kv: KVCacheConfig, num_blocks: int, device: torch.device,
                 num_swap_blocks: int = 0, cuda_graphs: CUDAGraphConfig | None = None,
                 capture_graphs: bool = True) -> None:
        self.model = model
        self.device = device
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        shape = (num_blocks + (1 if cuda_graphs else 0), *kv.shape)
        self.kv_caches = [torch.zeros(shape, dtype=kv.dtype, device=device) for _ in range(kv.num_layers)]
        # CPU swap space for preemption by swap, same layout; pinned so copies to a GPU can overlap.
        pin = device.type == "cuda"
        self.cpu_caches = [torch.zeros((num_swap_blocks, *kv.shape), dtype=kv.dtype, pin_memory=pin)
                           for _ in range(kv.num_layers)] if num_swap_blocks else []
        self.all_rows = False  # an embedding artifact pooling the mean: every prompt row comes back (prompt_rows)
        self.lora = None  # lora.LoRAManager, set by the engine for an artifact with adapter slots
        self.graph_runner = None
        if cuda_graphs is not None:
            self.graph_runner = CUDAGraphRunner(model, self.kv_caches, cuda_graphs.batch_sizes,
                                                cuda_graphs.max_blocks_per_seq, kv.block_size,
                                                scratch_block=num_blocks, device=device)
            if capture_graphs:
                self.graph_runner.capture()

    def shutdown(self) -> None:
        """Nothing to stop: the model runs in this process (the executor contract, runtime/worker/executor.py)."""

    def swap(self, batch: ScheduledBatch) -> None:
        """Copies the step's swapped-out blocks to CPU and swapped-in blocks back (before the forward pass)."""
        if batch.swap_out:
            dev, cpu = self._swap_ids(batch.swap_out, device_first=True)
            for gpu_cache, cpu_cache in zip(self.kv_caches, self.cpu_caches, strict=True):
                cpu_cache[cpu] = gpu_cache[dev].to("cpu")
        if batch.swap_in:
            dev, cpu = self._swap_ids(batch.swap_in, device_first=False)
            for gpu_cache, cpu_cache in zip(self.kv_caches, self.cpu_caches, strict=True):
                gpu_cache[dev] = cpu_cache[cpu].to(self.device, non_blocking=True)

    def _swap_ids(self, pairs: list[tuple[int, int]], *, device_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(device block ids on the device, cpu block ids) of `pairs`; built once per step, not once per layer."""
        first, second = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*pairs, strict=True))
        dev, cpu = (first, second) if device_first else (second, first)
        return dev.to(self.device), cpu

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, LogitsLayout]:
        host, layout = self.plan(batch)
        fb = self.forward_batch(host)
        if self.lora is not None:  # the step's adapters, paged into slots; none: the base model's fast path
            starts = host.query_start_loc
            fb.lora = self.lora.prepare([(seq.lora_id, starts[i], starts[i + 1] - starts[i])
                                         for i, seq in enumerate(batch.seqs)], len(host.input_ids))
            if fb.lora is not None:
                fb.lora_ids = host_to_device([-1 if s.lora_id is None else self.lora.slot_of(s.lora_id)
                                              for s in batch.seqs], torch.int32, self.device)
        return fb, layout

    def plan(self, batch: ScheduledBatch) -> tuple[HostBatch, LogitsLayout]:
        """The step's ForwardBatch as host lists, and which logits rows are whose (`prepare` without the copies
        to the device; a distributed executor sends these to its ranks)."""
        bs = self.block_size
        seqs, num_decodes = batch.seqs, batch.num_decodes
        # Decodes (first in the batch) run one token each, the last one sampled, and never owe prompt
        # logprobs: their rows are filled without the general per-token loop below.
        input_ids: list[int] = []
        positions = [seq.num_computed_tokens for seq in seqs[:num_decodes]]
        slots: list[int] = []
        for seq, pos in zip(seqs[:num_decodes], positions):
            table = seq.block_table
            assert pos // bs < len(table), f"seq {seq.seq_id}: {len(table)} blocks cannot hold {pos + 1} tokens"
            input_ids.append(seq.token_ids[pos])
            slots.append(table[pos // bs] * bs + pos % bs)
        query_start_loc = list(range(num_decodes + 1))
        seq_lens = [pos + 1 for pos in positions]
        logits_indices = list(range(num_decodes))
        sample_rows: list[int | None] = list(range(num_decodes))
        prompt_rows: list[tuple[int, int, int] | None] = [None] * num_decodes
        for seq, n in zip(seqs[num_decodes:], batch.num_new_tokens[num_decodes:], strict=True):
            start, end, base = seq.num_computed_tokens, seq.num_computed_tokens + n, query_start_loc[-1]
            input_ids.extend(seq.token_ids[start:end])
            drafts = seq.draft_token_ids
            input_ids.extend(drafts)  # verifying: the drafts after the last token
            positions.extend(range(start, end))
            table = seq.block_table
            assert len(table) * bs >= end, f"seq {seq.seq_id}: {len(table)} blocks cannot hold {end} tokens"
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(base + n)
            seq_lens.append(end)
            if drafts:  # every row scored (a drafting seq owes no prompt logprobs: Engine._drafts_for)
                prompt_rows.append(None)
                sample_rows.append(len(logits_indices))
                logits_indices.extend(range(base, base + n))
                continue
            rows = None
            if self.all_rows:  # every row of the chunk (then the last one again as the sample row)
                rows = (len(logits_indices), n, start)
                logits_indices.extend(range(base, base + n))
            elif seq.needs_prompt_logprobs():
                lo = max(start, seq.num_prompt_logprobs - 1)
                hi = min(end, seq.num_prompt_tokens - 1)
                if hi > lo:
                    rows = (len(logits_indices), hi - lo, lo)
                    logits_indices.extend(range(base + lo - start, base + hi - start))
            prompt_rows.append(rows)
            if end == seq.num_tokens:
                sample_rows.append(len(logits_indices))
                logits_indices.append(base + n - 1)
            else:
                sample_rows.append(None)

        # One tensor from one padded nested list: a tensor per row costs more than the rest of the step.
        max_blocks = max(cdiv(length, bs) for length in seq_lens)
        tables = []
        for seq, length in zip(seqs, seq_lens):
            used = cdiv(length, bs)
            tables.append(seq.block_table[:used] + [-1] * (max_blocks - used))

        host = HostBatch(input_ids, positions, query_start_loc, seq_lens, tables, slots, logits_indices, num_decodes)
        return host, LogitsLayout(sample_rows=sample_rows, prompt_rows=prompt_rows)

    def forward_batch(self, host: HostBatch) -> ForwardBatch:
        def i32(values: list) -> torch.Tensor:
            return host_to_device(values, torch.int32, self.device)

        return ForwardBatch(input_ids=i32(host.input_ids), positions=i32(host.positions),
                            query_start_loc=i32(host.query_start_loc), seq_lens=i32(host.seq_lens),
                            block_tables=i32(host.block_tables),
                            slot_mapping=host_to_device(host.slot_mapping, torch.int64, self.device),
                            logits_indices=i32(host.logits_indices), num_decodes=host.num_decodes,
                            dp_num_tokens=host.dp_num_tokens, dp_num_rows=host.dp_num_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                input_patch: tuple[list[int], list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, LogitsLayout]:
        """`input_patch` = (input rows, token rows, tokens): those input ids are taken, on the device, from a
        previous step's sampled tokens (async scheduling: their values are not on the host yet). CUDA-graph
        replay then copies them into the graph's static input buffer, device to device."""
        self.swap(batch)
        fb, layout = self.prepare(batch)
        if input_patch is not None:
            dst, src, tokens = input_patch
            k = len(dst)
            if dst == src and dst[-1] == k - 1:  # steady decode: the same leading rows, in the same order
                fb.input_ids[:k].copy_(tokens[:k])
            else:
                index = host_to_device([dst, src], torch.int64, self.device)
                fb.input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(fb.input_ids.dtype))
        return self.run(fb), layout

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """One forward pass (a captured graph where one covers the batch): float32 logits, a row per logits index."""
        logits = self.graph_runner.run(fb) if self.graph_runner is not None else None
        if logits is None:
            logits = self.model.forward(fb, self.kv_caches)
        # data-parallel attention: every rank's rows come back, gathered in rank order
        rows = sum(fb.dp_num_rows) if fb.dp_num_rows is not None else fb.logits_indices.shape[0]
        assert logits.dim() == 2 and logits.shape[0] == rows, (
            f"model returned logits {tuple(logits.shape)}, expected [{rows}, vocab]")
        return logits.float()

    @torch.inference_mode()
    def execute_with_hidden(self, batch: ScheduledBatch, aux_layers: tuple[int, ...] = ()
                            ) -> tuple[torch.Tensor, LogitsLayout, DraftInput]:
        """`execute`, eagerly, also keeping what a draft head reads afterwards: the step's ForwardBatch and the
        hidden states of every token (speculative decoding): the last ones, or with `aux_layers` those entering
        these decoder layers (model.py's forward(aux_layers=...), EAGLE-3)."""
        self.swap(batch)
        fb, layout = self.prepare(batch)
        if aux_layers:
            logits, aux = self.model.forward(fb, self.kv_caches, aux_layers=aux_layers)
            return logits.float(), layout, DraftInput(fb, None, aux)
        logits, hidden = self.model.forward(fb, self.kv_caches, return_hidden=True)
        return logits.float(), layout, DraftInput(fb, hidden)

    @torch.inference_mode()
    def propose(self, method: str, draft: DraftInput, input_ids: list[int], rows: list[int],
                with_hidden: bool = False) -> list[int] | tuple[list[int], torch.Tensor | None]:
        """Runs the draft head `method` over the step's positions (writing its own KV layers), `input_ids` being
        the step's tokens shifted by one; returns the greedy draft token at each of `rows` (`with_hidden`: and the
        head's own hidden state there, None from a head that returns none, for chaining it)."""
        fb = replace(draft.batch, input_ids=torch.tensor(input_ids, dtype=torch.int32, device=self.device),
                     logits_indices=torch.tensor(rows, dtype=torch.int32, device=self.device))
        out = getattr(self.model, method)(fb, draft.hidden, self.kv_caches)
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        tokens = logits.argmax(dim=-1).tolist()
        if not with_hidden:
            return tokens
        return tokens, None if hidden is None else hidden[fb.logits_indices.long()]
