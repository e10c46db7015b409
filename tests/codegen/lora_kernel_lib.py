"""Shared by the Triton LoRA kernel tests (interpreter: test_triton_lora.py; CUDA: tests/gpu/test_lora_triton_gpu.py):
slot weights laid out as runtime/worker/lora.py's LoRAManager lays them out, the batch its `prepare` builds, and a
per-token float64 reference."""
from __future__ import annotations

import torch
from kiln.runtime.worker.lora import LoRABatch

TARGET = "decoder.wqkv"


def lora_weights(layers, slots, rows, max_rank, k, ranks, dtype, g, device="cpu"):
    """A [L, S, m*R, K] and block-diagonal B [L, S, N, m*R] as the LoRAManager lays them out: slot s's module j
    has rank ranks[s][j] (<= max_rank), zero padding past it."""
    m, n = len(rows), sum(rows)
    a = torch.zeros(layers, slots, m * max_rank, k)
    b = torch.zeros(layers, slots, n, m * max_rank)
    for s in range(slots):
        for j, nj in enumerate(rows):
            r, row0 = ranks[s][j], sum(rows[:j])
            a[:, s, j * max_rank:j * max_rank + r] = torch.randn(layers, r, k, generator=g) * k ** -0.5
            b[:, s, row0:row0 + nj, j * max_rank:j * max_rank + r] = torch.randn(layers, nj, r, generator=g)
    return a.to(device, dtype), b.to(device, dtype)


def lora_reference(x, y, a, b, slot_of_row, rows, max_rank, layer):
    """Each adapter's rows, module by module (as PEFT computes each projection), in float64."""
    out = y.double().clone()
    for s in sorted({v for v in slot_of_row if v is not None}):
        idx = torch.tensor([t for t, v in enumerate(slot_of_row) if v == s], device=x.device)
        for j, nj in enumerate(rows):
            row0 = sum(rows[:j])
            aj = a[layer, s, j * max_rank:(j + 1) * max_rank].double()
            bj = b[layer, s, row0:row0 + nj, j * max_rank:(j + 1) * max_rank].double()
            out[idx, row0:row0 + nj] += (x[idx].double() @ aj.T) @ bj.T
    return out


def lora_batch(a, b, slot_of_row, slots_order, seg_rank, empty=()):
    """The LoRABatch LoRAManager.prepare builds: one segment per slot in `slots_order` (its rows ascending),
    plus empty segments (slots in `empty`) a kernel must skip."""
    segments, seg_rows, ranks = [], [], []
    for s in [*slots_order, *empty]:
        rows = [t for t, v in enumerate(slot_of_row) if v == s and s not in empty]
        segments.append((s, torch.tensor(rows, dtype=torch.int64, device=a.device), frozenset({TARGET})))
        seg_rows.append(rows)
        ranks.append(seg_rank[s])
    return LoRABatch({TARGET: (a, b)}, segments, seg_rows, {TARGET: ranks})
