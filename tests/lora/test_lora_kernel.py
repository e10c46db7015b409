"""The cpu `lora` kernel (codegen/templates/cpu/kernels.py.j2, rendered for LoRA artifacts) against a per-token
torch reference: rows of several adapters and of none in one batch, fused modules side by side, the one-adapter
fast path, and a segment whose adapter does not adapt the target. The kernel is not in a base artifact's library."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from kiln.codegen.render import template_env
from kiln.runtime.worker.lora import LoRABatch

L, S, R, K, ROWS = 2, 3, 4, 16, (8, 4, 4)  # layers, slots, max_rank, in_features, fused q/k/v rows
N, M = sum(ROWS), len(ROWS)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_kernel") / "cpu_kernels.py"
    path.write_text(template_env().get_template("cpu/kernels.py.j2").render(kiln_version="t", lora=True))
    spec = importlib.util.spec_from_file_location("kiln_test_lora_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slot_weights(g):
    """A [L, S, M*R, K] and a block-diagonal B [L, S, N, M*R], as the LoRAManager lays them out, ranks < R."""
    a = torch.zeros(L, S, M * R, K)
    b = torch.zeros(L, S, N, M * R)
    for s in range(S):
        for j, rows in enumerate(ROWS):
            r = 1 + (s + j) % R
            row0 = sum(ROWS[:j])
            a[:, s, j * R:j * R + r] = torch.randn(L, r, K, generator=g)
            b[:, s, row0:row0 + rows, j * R:j * R + r] = torch.randn(L, rows, r, generator=g)
    return a, b


def _reference(x, y, a, b, slot_of_token, layer):
    out = y.clone()
    for t, s in enumerate(slot_of_token):
        if s is not None:
            for j, rows in enumerate(ROWS):  # module by module, as PEFT computes each projection
                row0 = sum(ROWS[:j])
                aj, bj = a[layer, s, j * R:(j + 1) * R], b[layer, s, row0:row0 + rows, j * R:(j + 1) * R]
                out[t, row0:row0 + rows] += (x[t] @ aj.T) @ bj.T
    return out


def test_mixed_adapters_and_base_rows(kernels):
    g = torch.Generator().manual_seed(0)
    a, b = _slot_weights(g)
    T = 9
    x, y = torch.randn(T, K, generator=g), torch.randn(T, N, generator=g)
    slot_of_token = [0, 2, 2, None, 0, 1, None, 0, 1]
    segments = []
    for s in (0, 2, 1):
        rows = [t for t, v in enumerate(slot_of_token) if v == s]
        segments.append((s, torch.tensor(rows), frozenset({"decoder.wqkv"})))
    batch = LoRABatch({"decoder.wqkv": (a, b)}, segments)
    for layer in range(L):
        got = kernels.lora(x, y, batch, "decoder.wqkv", layer)
        torch.testing.assert_close(got, _reference(x, y, a, b, slot_of_token, layer), atol=1e-5, rtol=1e-5)
        assert torch.equal(got[3], y[3]) and torch.equal(got[6], y[6])  # base rows: untouched, bit for bit


def test_one_adapter_for_the_whole_batch_and_absent_targets(kernels):
    g = torch.Generator().manual_seed(1)
    a, b = _slot_weights(g)
    x, y = torch.randn(5, K, generator=g), torch.randn(5, N, generator=g)
    whole = LoRABatch({"decoder.wqkv": (a, b)}, [(1, None, frozenset({"decoder.wqkv"}))])
    torch.testing.assert_close(kernels.lora(x, y, whole, "decoder.wqkv", 1),
                               _reference(x, y, a, b, [1] * 5, 1), atol=1e-5, rtol=1e-5)
    other = LoRABatch({"decoder.wqkv": (a, b)}, [(1, None, frozenset({"decoder.wo"}))])
    assert kernels.lora(x, y, other, "decoder.wqkv", 0) is y  # the adapter leaves this linear alone
    assert kernels.lora(x, y, None, "decoder.wqkv", 0) is y  # no adapter in the step


def test_base_library_has_no_lora_kernel():
    assert "def lora(" not in template_env().get_template("cpu/kernels.py.j2").render(kiln_version="t")
