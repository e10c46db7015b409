"""The executor contract: the one structure the runtime hands the generated model each step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ForwardBatch:
    """Flat, token-major ("varlen") batch; decodes come first, prefills after.

    Built by the model runner every step. The generated `Model.forward(batch, kv_caches)` reads only this
    and the per-layer KV tensors; it writes each new token's K/V to `slot_mapping` before attending.
    """

    input_ids: torch.Tensor  # [T] int32 — all scheduled tokens of all sequences
    positions: torch.Tensor  # [T] int32 — position of each token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int32 — start of each sequence's tokens in input_ids
    seq_lens: torch.Tensor  # [B] int32 — total context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32 — physical KV block ids, -1 padded
    slot_mapping: torch.Tensor  # [T] int64 — block_id * block_size + offset for each new token
    logits_indices: torch.Tensor  # [L] int32 — rows of the hidden states that produce logits
    lora_ids: torch.Tensor | None = None  # [B] int32, -1 = base model
    lora: Any = None  # lora.LoRABatch: the adapter slots and which tokens use which (None: no adapter this step)
    num_decodes: int = 0  # the first num_decodes sequences each have exactly one new token
    # data-parallel attention (a parallel artifact with dp > 1): this batch is one rank's sequences; the token and
    # logits row counts of every rank's batch in this step, by which the model gathers and scatters MLP rows
    dp_num_tokens: list[int] | None = None
    dp_num_rows: list[int] | None = None
    # a vocab-parallel LM head (gather_logits) may return only each row's top `logit_candidates` logits, the other
    # columns -inf: a mesh executor sets it when the step samples from no more (greedy: 1, top-k: k); 0: all
    logit_candidates: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
