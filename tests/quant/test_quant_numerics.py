"""Each scheme's dequantized weights equal the reference to the format's precision; kernels equal references."""
from __future__ import annotations

import pytest
import torch
from kiln.compiler.quant import dequant_awq, dequant_gptq, fp8_dequantize, fp8_quantize, fp8_scaled_matmul
from quant_testlib import (
    e4m3_half_ulp,
    fp8_reference,
    int4_dequant_reference,
    load_cpu_kernels,
    pack_awq,
    pack_gptq_cols,
    pack_gptq_rows,
    rtn_int4,
)


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return load_cpu_kernels(tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_round_trip_within_half_ulp(granularity, K):
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, 7] = 1.5  # an outlier: per-tensor scales see it everywhere, channel/block only locally
    w_q, scale = fp8_quantize(w, granularity, 128)
    assert w_q.dtype == torch.float8_e4m3fn and scale.shape == {"tensor": (1,), "channel": (200,),
                                                                "block": (2, 3)}[granularity]
    deq = fp8_dequantize(w_q, scale, 128 if granularity == "block" else 0)
    if granularity == "block":
        per_elem = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    else:
        per_elem = scale.reshape(-1, 1).expand(200, 300)
    bound = e4m3_half_ulp(w / per_elem) * per_elem
    assert bool(((deq - w).abs() <= bound * (1 + 1e-6)).all())
    ref_q, ref_s = fp8_reference(w, granularity)  # the test's own quantizer agrees bit for bit
    assert torch.equal(ref_q.view(torch.uint8), w_q.view(torch.uint8))
    torch.testing.assert_close(ref_s.reshape(scale.shape), scale, rtol=0, atol=0)
    torch.testing.assert_close(K.dequant_fp8(w_q, scale, granularity, 128, "f32"), deq, rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_dynamic_activation_emulates_scaled_mm(granularity, K):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=g) * 0.1, torch.randn(5, 256, generator=g)
    w_q, scale = fp8_quantize(w, granularity, 128)
    ref = fp8_scaled_matmul(x, w_q, scale, 128 if granularity == "block" else 0)
    got = K.linear_fp8(x, w_q, scale, granularity=granularity, block=128, act="dynamic_per_token")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the emulation is fp8 x fp8 products: close to, not equal to, the exact-weight GEMM
    exact = x @ w.T
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("sym", [False, True])
def test_awq_unpack_exact(sym, K):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q, z, s, g_idx = rtn_int4(w, 128, sym=sym)
    qweight, qzeros = pack_awq(q), pack_awq(z)
    assert qweight.shape == (256, 8) and qzeros.shape == (2, 8)
    ref = int4_dequant_reference(q, z, s, g_idx)
    assert torch.equal(dequant_awq(qweight, qzeros, s, 128), ref)
    assert torch.equal(K.dequant_int4(qweight, qzeros, s, format="awq", group=128, dtype="f32"), ref)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["v1", "v2"])
def test_gptq_unpack_exact(act_order, fmt, K):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen)
    g_idx = torch.randperm(256, generator=gen) // 128 if act_order else None
    q, z, s, g_idx = rtn_int4(w, 128, sym=True, g_idx=g_idx)
    stored_z = z - 1 if fmt == "v1" else z  # AutoGPTQ/GPTQModel (v1) store zero - 1
    qweight, qzeros = pack_gptq_rows(q), pack_gptq_cols(stored_z)
    assert qweight.shape == (32, 64) and qzeros.shape == (2, 8)
    ref = int4_dequant_reference(q, z, s, g_idx)
    offset = 1 if fmt == "v1" else 0
    assert torch.equal(dequant_gptq(qweight, qzeros, s, g_idx.int(), offset), ref)
    got = K.dequant_int4(qweight, qzeros, s, g_idx.int(), format="gptq", group=128, zero_offset=offset, dtype="f32")
    assert torch.equal(got, ref)


def test_int4_linear_caches_dequantized_weight(K):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    q, z, s, g_idx = rtn_int4(w, 128)
    qweight, qzeros = pack_awq(q), pack_awq(z)
    x = torch.randn(3, 128)
    y1 = K.linear_w4a16(x, qweight, qzeros, s, format="awq", group=128)
    y2 = K.linear_w4a16(x, qweight, qzeros, s, format="awq", group=128)
    torch.testing.assert_close(y1, x @ int4_dequant_reference(q, z, s, g_idx).T, rtol=0, atol=1e-5)
    assert torch.equal(y1, y2) and len(K._dequantized) >= 1


def test_fp8_kv_cache_write_read(K):
    """The kernel stores K/V / scale in e4m3 and reads back fp8 x scale: the reference's fake quantization."""
    from kiln.compiler.quant import fp8_fake_quantize

    k = torch.randn(6, 2, 8)
    v = torch.randn(6, 2, 8)
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    ks, vs = k.abs().amax(dim=(0, 2)) / 448, v.abs().amax(dim=(0, 2)) / 448
    K.write_kv_cache(k, v, cache, torch.arange(6), ks, vs)
    got = cache[:, 0].flatten(0, 1)[:6].float() * ks[:, None]
    torch.testing.assert_close(got, fp8_fake_quantize(k, ks, dim=1), rtol=0, atol=0)
