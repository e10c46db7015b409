"""The Triton weight-only quantized GEMM (int4 AWQ / GPTQ, fp8) vs the ops' torch references, under the
interpreter.

Packed weights are random int32 words (every nibble pattern is a valid int4 weight), so the test does not
depend on a packer; the reference is the op table's (`kiln.compiler.ops`, numerics in kiln.compiler.quant),
not the CPU kernel library the Triton launcher falls back to. Shapes are small but take several column tiles,
K tiles, groups and split-K ranges. Tolerances: fp32 within 1e-4 relative/absolute of the reference (the
dequantized weight is bit-identical; only the summation order differs); bf16 within 2e-2 (the reference rounds
the weight to bf16 as the kernel does, but the interpreter truncates the fp32 -> bf16 casts).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import render_kernels  # noqa: E402
from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from kiln.compiler.quant import fp8_quantize  # noqa: E402


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("triton_quant"))


@pytest.fixture
def small_tiles(K, monkeypatch):
    """Tiles small enough that the test shapes take several of each."""
    monkeypatch.setattr(K, "WQ_BLOCK_N", 32)
    monkeypatch.setattr(K, "WQ_BLOCK_K", 16)


def _reference(op: str, x, *ins, **attrs):
    return OPS[op].reference(RefContext(positions=torch.zeros(0, dtype=torch.int64)), x, *ins, **attrs)


def _int4(fmt: str, n: int, k: int, group: int, g: torch.Generator, act_order: bool = False):
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)  # noqa: E731
    qweight = words(k, n // 8) if fmt == "awq" else words(k // 8, n)
    qzeros = words(k // group, n // 8)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(torch.float16)
    if fmt == "awq":
        return qweight, qzeros, scales
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return qweight, qzeros, scales, g_idx.to(torch.int32)


def _close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)],
                         ids=["awq", "gptq", "gptq-act-order"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matches_reference(K, small_tiles, fmt, act_order, m, dtype):
    n, k, group = 72, 96, 32  # N not a multiple of the column tile; 3 groups of 2 K tiles
    g = torch.Generator().manual_seed(m + 10 * (fmt == "gptq") + act_order)
    packed = _int4(fmt, n, k, group, g, act_order)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if m == 5 else None
    zero_offset = 1 if fmt == "gptq" else 0
    extra = (bias,) if bias is not None else ()
    out = K.linear_w4a16(x, *packed, *extra, format=fmt, group=group, zero_offset=zero_offset)
    ref = _reference("linear_w4a16", x, *packed, *extra, format=fmt, group=group, zero_offset=zero_offset)
    _close(out, ref, dtype)


@pytest.mark.parametrize("split_k", [1, 2, 6])
def test_w4a16_split_k_and_3d_input(K, small_tiles, split_k):
    """The same product whatever the K split (1: one launch, no partial sums), on a [B, T, K] input."""
    n, k, group = 64, 96, 16
    g = torch.Generator().manual_seed(split_k)
    packed = _int4("awq", n, k, group, g)
    x = torch.randn(2, 3, k, generator=g)
    bias = torch.randn(n, generator=g)
    out = K.wq_gemm(x, packed[0], packed[1], packed[2], None, bias, format="awq", group=group, split_k=split_k)
    ref = _reference("linear_w4a16", x, *packed, bias, format="awq", group=group, zero_offset=0)
    assert out.shape == (2, 3, n)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_w4a16_default_tiles_and_large_m_fallback(K):
    """The rendered tile sizes (no monkeypatch), and more rows than the kernel takes (the torch path)."""
    n, k, group = 256, 256, 128
    g = torch.Generator().manual_seed(3)
    packed = _int4("gptq", n, k, group, g)
    for m in (1, K.WQ_MAX_M + 1):
        x = torch.randn(m, k, generator=g)
        out = K.linear_w4a16(x, *packed, format="gptq", group=group, zero_offset=1)
        ref = _reference("linear_w4a16", x, *packed, format="gptq", group=group, zero_offset=1)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_only_matches_reference(K, small_tiles, granularity, m, dtype):
    n, k = 48, 80  # K not a multiple of the K tile
    g = torch.Generator().manual_seed(m)
    w_q, scale = fp8_quantize(torch.randn(n, k, generator=g) * 0.05, granularity)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    out = K.linear_fp8(x, w_q, scale, bias, granularity=granularity, block=0, act="none")
    ref = _reference("linear_fp8", x, w_q, scale, bias, granularity=granularity, block=0, act="none")
    _close(out, ref, dtype)
