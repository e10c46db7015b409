"""CUDA-graph replay of decode steps: one graph per batch-size bucket over static input buffers.

A pure-decode batch of B sequences (B <= the largest bucket) is padded to the smallest bucket >= B, copied
into the static buffers the graphs were captured on, and replayed; its logits are the first B rows. Any
batch with a prefill, more sequences than the largest bucket, or LoRA runs eagerly (`run` returns None).

Padding rows write and read only a dedicated **scratch KV block** (`scratch_block`, one block past the ones
the BlockManager hands out): token 0 at position 0, seq_len 1, every block-table entry = the scratch block,
slot_mapping = its first slot. To every kernel a padding row is an ordinary one-token sequence, so neither
the CPU nor the Triton attention needs a special case (a slot of -1 would need one in each KV-write kernel,
and would index the last block in torch). The scratch block's contents are garbage and never read by a real
sequence. Unused block-table columns of real rows also hold the scratch block, so any over-read stays in
bounds.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from ..forward_batch import ForwardBatch


class CUDAGraphRunner:
    """Owns the static buffers and, once `capture()` ran, one CUDA graph per bucket (sharing one memory pool).

    Without `capture()` (CPU tests, or `run` before capture) a bucket is "replayed" as an eager forward over
    the same padded static buffers: the padding and bucketing are then testable without a GPU.
    Logits returned by `run` are a view of graph memory, valid until the next `run`.
    """

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], batch_sizes: Sequence[int], max_blocks: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        assert batch_sizes and min(batch_sizes) >= 1, f"bad CUDA-graph batch sizes {batch_sizes}"
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.device = device
        n = self.max_bs

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.input_ids, self.positions, self.seq_lens = i32(n), i32(n), i32(n)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        # Pure decode: sequence b is token b and produces logits row b, for every bucket.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int32, device=device)
        self.static_batches = {bs: ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            logits_indices=self.logits_indices[:bs], num_decodes=bs) for bs in self.batch_sizes}
        self._pad(0, n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # measured by capture(): device memory the graphs' pool took

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding `num_seqs` sequences; None above the largest."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def can_run(self, fb: ForwardBatch) -> bool:
        n = fb.num_seqs
        return (0 < n <= self.max_bs and fb.num_decodes == n and fb.num_tokens == n and fb.lora_ids is None
                and fb.logits_indices.shape[0] == n)

    def run(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, vocab] of a pure-decode batch through its bucket's graph; None: run it eagerly."""
        if not self.can_run(fb):
            return None
        n = fb.num_seqs
        bs = self.bucket_for(n)
        self._load(fb, bs)
        if self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self.model.forward(self.static_batches[bs], self.kv_caches)[:n]

    def _load(self, fb: ForwardBatch, bs: int) -> None:
        n, width = fb.num_seqs, fb.block_tables.shape[1]
        assert width <= self.max_blocks, f"block table of {width} blocks exceeds the graphs' {self.max_blocks}"
        self.input_ids[:n].copy_(fb.input_ids, non_blocking=True)
        self.positions[:n].copy_(fb.positions, non_blocking=True)
        self.seq_lens[:n].copy_(fb.seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(fb.slot_mapping, non_blocking=True)
        self.block_tables[:n].fill_(self.scratch_block)
        self.block_tables[:n, :width].copy_(fb.block_tables, non_blocking=True)
        self._pad(n, bs)

    def _pad(self, start: int, stop: int) -> None:
        """Rows start..stop-1 become one-token sequences living in the scratch block."""
        if start >= stop:
            return
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.seq_lens[start:stop] = 1
        self.slot_mapping[start:stop] = self.scratch_slot
        self.block_tables[start:stop] = self.scratch_block

    @torch.inference_mode()
    def capture(self) -> int:
        """Captures one graph per bucket, largest first so the smaller ones fit in the pool it leaves; returns
        (and keeps in `memory_bytes`) the device memory the capture took. Each bucket first runs once eagerly
        (outside the graph) so Triton compiles and cuBLAS sizes its workspace before capture."""
        assert self.device.type == "cuda", "CUDA graphs are captured on a CUDA device only"
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        self._pad(0, self.max_bs)
        for bs in reversed(self.batch_sizes):
            batch = self.static_batches[bs]
            self.model.forward(batch, self.kv_caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model.forward(batch, self.kv_caches)
            except Exception as e:
                raise RuntimeError(f"CUDA-graph capture of decode batch size {bs} failed ({type(e).__name__}: "
                                   f"{e}); load with enforce_eager=True to serve without graphs") from e
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = int(free_before - torch.cuda.mem_get_info(self.device)[0])
        return self.memory_bytes
