"""The Triton segmented LoRA kernels (codegen/templates/triton/kernels.py.j2 `lora`: one shrink and one expand
launch over every adapter of a step) under Triton's CPU interpreter, against a per-token float64 reference:
random segments of mixed adapters and base rows, ranks up to max_rank (and 0: an adapter that leaves the
linear alone), empty segments, a decode batch (one row per sequence, an adapter's rows scattered), long
prefill segments (several row tiles), fused q/k/v slices, split-K partial sums, fp32 and bf16."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from codegen_helpers import render_kernels  # noqa: E402
from lora_kernel_lib import TARGET, lora_batch, lora_reference, lora_weights  # noqa: E402


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("triton_lora"), lora=True)


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    else:  # bf16: x·A, the branch and the sum each rounded to bf16 (as the torch kernel rounds)
        torch.testing.assert_close(got.double(), want, atol=6e-2, rtol=2 ** -6)


CASES = {
    # name: (tokens, slot of each token (None: base), in_features, rows per module, max_rank)
    "prefill_fused_qkv": ([*[0] * 70, *[None] * 5, *[2] * 20, *[1] * 3], 96, (32, 16, 16), 8),
    "decode_scattered": ([1, None, 0, 1, 2, 0, None, 1, 2, 2, 0], 96, (32, 16, 16), 16),
    "split_k_gate_up": ([0, 2, None, 0, 1, 1, 2], 640, (48, 48), 8),
    "one_module_rank_64": ([*[1] * 17, None, *[0] * 9], 80, (40,), 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_segmented_lora_matches_reference(K, case, dtype):
    slot_of_row, k, rows, max_rank = CASES[case]
    g = torch.Generator().manual_seed(list(CASES).index(case))
    layers, slots, m = 2, 4, len(rows)
    # ranks per slot and module: up to max_rank, one below it, 1; slot 3 is resident but unused
    ranks = [[max_rank, max(1, max_rank // 2), 1][: m], [1 + (j * 5) % max_rank for j in range(m)],
             [max_rank] * m, [2] * m]
    a, b = lora_weights(layers, slots, rows, max_rank, k, ranks, dtype, g)
    T = len(slot_of_row)
    x, y = torch.randn(T, k, generator=g).to(dtype), torch.randn(T, sum(rows), generator=g).to(dtype)
    seg_rank = {s: max(r) for s, r in enumerate(ranks)}
    batch = lora_batch(a, b, slot_of_row, [2, 0, 1], seg_rank, empty=(3,))
    for layer in range(layers):
        want = lora_reference(x, y, a, b, slot_of_row, rows, max_rank, layer)
        got = K.lora(x, y.clone(), batch, TARGET, layer, rows=rows)
        _close(got, want, dtype)
        base = [t for t, s in enumerate(slot_of_row) if s is None]
        assert torch.equal(got[base], y[base]), "base-model rows must be untouched, bit for bit"
        torch.testing.assert_close(got, K._ref.lora(x, y, batch, TARGET, layer), atol=1e-4 if dtype == torch.float32
                                   else 6e-2, rtol=1e-4 if dtype == torch.float32 else 2 ** -6)


def test_split_k_is_exercised_and_decode_splits_prefill_does_not(K):
    assert K.lora_split_k(3 * 2, 640, torch.device("cpu")) == 2  # the split_k_gate_up case: 2 partials
    assert K.lora_split_k(3 * 1 * 3, 96, torch.device("cpu")) == 1  # K too small to split
    assert K.lora_split_k(1000, 4096, torch.device("cpu")) == 1  # the grid fills the GPU already
    assert K.lora_split_k(4, 4096, torch.device("cpu")) == 8


def test_rank_zero_target_and_no_adapter_leave_y_alone(K):
    g = torch.Generator().manual_seed(5)
    rows, max_rank, k = (16, 16), 8, 32
    a, b = lora_weights(1, 2, rows, max_rank, k, [[4, 4], [8, 8]], torch.float32, g)
    x, y = torch.randn(6, k, generator=g), torch.randn(6, 32, generator=g)
    slot_of_row = [0, 0, 1, 1, 1, 0]
    # slot 1's adapter leaves this linear alone (rank 0 here): its rows keep y; slot 0's are adapted
    batch = lora_batch(a, b, slot_of_row, [0, 1], {0: 4, 1: 0})
    got = K.lora(x, y.clone(), batch, TARGET, 0, rows=rows)
    assert torch.equal(got[2:5], y[2:5])
    want = lora_reference(x, y, a, b, [0, 0, None, None, None, 0], rows, max_rank, 0)
    _close(got, want, torch.float32)
    none = lora_batch(a, b, slot_of_row, [0, 1], {0: 0, 1: 0})
    same = y.clone()
    assert K.lora(x, same, none, TARGET, 0, rows=rows) is same and torch.equal(same, y)
    assert K.lora(x, y, None, TARGET, 0, rows=rows) is y
