"""The Triton segmented LoRA kernels on a CUDA GPU at Llama-3-8B-like shapes (hidden 4096, fused q/k/v rows
4096 + 1024 + 1024, gate/up 2 x 14336, ranks up to 64) against a float64 reference on the same inputs: a decode
batch of 64 sequences over 4 adapters and the base (split-K shrink), and a prefill of long segments, in fp32
(ieee dots) and bf16 (x·A, the branch and the sum rounded to bf16, as the torch kernel rounds)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))

from lora_kernel_lib import TARGET, lora_batch, lora_reference, lora_weights  # noqa: E402

DEV = "cuda"


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    from codegen_helpers import render_kernels

    mod = render_kernels(tmp_path_factory.mktemp("gpu_lora"), head_dim=128, num_heads=32, num_kv_heads=8,
                         dtype="bfloat16", block_size=16, lora=True)
    assert not mod.INTERPRET
    return mod


def _slots(n: int, g: torch.Generator) -> list[int | None]:
    """n rows: slots 0..3 and the base (None), scattered."""
    return [None if v == 4 else int(v) for v in torch.randint(0, 5, (n,), generator=g).tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["decode_qkv", "prefill_gate_up"])
def test_segmented_lora_on_gpu(K, shape, dtype):
    g = torch.Generator().manual_seed(0)
    if shape == "decode_qkv":
        rows, k, max_rank = (4096, 1024, 1024), 4096, 64
        slot_of_row = _slots(64, g)
    else:
        rows, k, max_rank = (14336, 14336), 4096, 16
        slot_of_row = [*[0] * 300, *[None] * 40, *[3] * 129, *[1] * 7]
    ranks = [[max_rank] * len(rows), [8] * len(rows), [max_rank // 2] * len(rows), [1] * len(rows)]
    a, b = lora_weights(1, 4, rows, max_rank, k, ranks, dtype, g, device=DEV)
    x = torch.randn(len(slot_of_row), k, generator=g).to(DEV, dtype)
    y = torch.randn(len(slot_of_row), sum(rows), generator=g).to(DEV, dtype)
    present = [s for s in (2, 0, 3, 1) if s in slot_of_row]
    batch = lora_batch(a, b, slot_of_row, present, {s: max(r) for s, r in enumerate(ranks)})
    got = K.lora(x, y.clone(), batch, TARGET, 0, rows=rows)
    torch.cuda.synchronize()
    want = lora_reference(x, y, a, b, slot_of_row, rows, max_rank, 0)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.double(), want, atol=6e-2, rtol=2 ** -6)
    base = [t for t, s in enumerate(slot_of_row) if s is None]
    assert torch.equal(got[base], y[base])
