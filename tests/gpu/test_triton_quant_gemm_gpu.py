"""The Triton weight-only quantized GEMM (int4 AWQ / GPTQ incl. act-order, fp8) on a CUDA GPU at Llama-3-8B
projection shapes, vs the ops' torch references on the same device.

Shapes: merged qkv [6144, 4096] and down [4096, 14336] (merged gate_up [28672, 4096] for AWQ); batch 1
(split-K GEMV), 64 (tensor-core tiles) and 300 (past WQ_MAX_M: the torch path). Few shapes on purpose: each
constexpr variant of the kernel is a Triton compile. Packed weights are random
int32 words. Tolerance: the reference dequantizes to the same bf16 weight, so only the fp32 summation order
and the final bf16 rounding differ: max error within 1% of the output's largest magnitude (fp32 inputs: 1e-4).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from kiln.compiler.quant import fp8_quantize  # noqa: E402

DEV = "cuda"
SHAPES = [(6144, 4096), (4096, 14336)]


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(128, 32, 8, 16)


def _reference(op: str, x, *ins, **attrs):
    return OPS[op].reference(RefContext(positions=torch.zeros(0, dtype=torch.int64)), x, *ins, **attrs)


def _int4(fmt, n, k, group, g, act_order=False):
    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, device=DEV, dtype=torch.int64).to(torch.int32)

    qweight = words(k, n // 8) if fmt == "awq" else words(k // 8, n)
    scales = (torch.rand(k // group, n, generator=g, device=DEV) * 0.02 + 0.001).to(torch.float16)
    packed = (qweight, words(k // group, n // 8), scales)
    if fmt == "awq":
        return packed
    g_idx = torch.arange(k, device=DEV) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g, device=DEV)]
    return (*packed, g_idx.to(torch.int32))


def _close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_cuda
    err = (out.float() - ref.float()).abs().max()
    bound = (1e-4 if dtype == torch.float32 else 1e-2) * ref.float().abs().max()
    assert err <= bound, f"max error {err:.4g} > {bound:.4g}"


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)],
                         ids=["awq", "gptq", "gptq-act-order"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_w4a16_gpu(K, fmt, act_order, n, k, m):
    g = torch.Generator(device=DEV).manual_seed(n + k + m)
    packed = _int4(fmt, n, k, 128, g, act_order)
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    zero_offset = 1 if fmt == "gptq" else 0
    out = K.linear_w4a16(x, *packed, format=fmt, group=128, zero_offset=zero_offset)
    ref = _reference("linear_w4a16", x.float(), *packed, format=fmt, group=128, zero_offset=zero_offset)
    _close(out, ref, torch.bfloat16)


def test_w4a16_gpu_gate_up_shape(K):
    n, k = 28672, 4096
    g = torch.Generator(device=DEV).manual_seed(5)
    packed = _int4("awq", n, k, 128, g)
    x = torch.randn(1, k, generator=g, device=DEV).to(torch.bfloat16)
    out = K.linear_w4a16(x, *packed, format="awq", group=128, zero_offset=0)
    _close(out, _reference("linear_w4a16", x.float(), *packed, format="awq", group=128, zero_offset=0),
           torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_gpu_fp32_and_bias(K, dtype):
    n, k = 4096, 4096
    g = torch.Generator(device=DEV).manual_seed(1)
    packed = _int4("awq", n, k, 128, g)
    x = torch.randn(3, k, generator=g, device=DEV).to(dtype)
    bias = torch.randn(n, generator=g, device=DEV).to(dtype)
    out = K.linear_w4a16(x, *packed, bias, format="awq", group=128, zero_offset=0)
    ref = _reference("linear_w4a16", x, *packed, bias, format="awq", group=128, zero_offset=0)
    _close(out, ref, dtype)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("m", [1, 64])
def test_fp8_weight_only_gpu(K, granularity, n, k, m):
    g = torch.Generator(device=DEV).manual_seed(n + k + m)
    w_q, scale = fp8_quantize(torch.randn(n, k, generator=g, device=DEV) * 0.02, granularity)
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    out = K.linear_fp8(x, w_q, scale, granularity=granularity, block=0, act="none")
    ref = _reference("linear_fp8", x.float(), w_q, scale, granularity=granularity, block=0, act="none")
    _close(out, ref, torch.bfloat16)


def test_w4a16_under_cuda_graph(K):
    """Captured once after a warm-up (the g_idx check happens there), replayed on new inputs."""
    n, k = 4096, 4096
    g = torch.Generator(device=DEV).manual_seed(2)
    packed = _int4("gptq", n, k, 128, g)
    x = torch.randn(1, k, generator=g, device=DEV).to(torch.bfloat16)
    K.linear_w4a16(x, *packed, format="gptq", group=128, zero_offset=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.linear_w4a16(x, *packed, format="gptq", group=128, zero_offset=1)
    x.copy_(torch.randn(1, k, generator=g, device=DEV).to(torch.bfloat16))
    graph.replay()
    ref = _reference("linear_w4a16", x.float(), *packed, format="gptq", group=128, zero_offset=1)
    _close(out, ref, torch.bfloat16)
