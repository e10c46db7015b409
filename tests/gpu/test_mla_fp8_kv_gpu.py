"""The Triton MLA absorbed decode over an fp8 (e4m3) latent cache on a CUDA GPU, at DeepSeek-V3 latent shapes
(kv_lora_rank 512, rope 64, 16 and 128 heads, KV block 16), vs the CPU library's torch path (dequantize the
gathered latent x scale, then attend) on the same fp8 cache. Tolerances as test_triton_moe_mla_gpu's MLA test:
fp32 1e-4, bf16 3e-2 absolute of an fp32 reference on the same inputs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_mla_gpu import BLOCK, DEV, _batch  # noqa: E402


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(128, 1, 1, BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_fp8_latent(K, dtype, heads):
    L, R, dn, dv = 512, 64, 128, 128
    seqs = [(700, 1), (33, 1), (1500, 1), (0, 1)]  # three decodes on the kernel, a fresh token on torch
    g = torch.Generator().manual_seed(heads)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 3
    batch = _batch(seqs, num_blocks, g)
    T = batch.num_tokens
    gd = torch.Generator(device=DEV).manual_seed(11)
    kv_scale = torch.tensor([4.0 / 448], device=DEV)
    kv = (torch.randn(num_blocks, BLOCK, L + R, device=DEV, generator=gd) / kv_scale).clamp(-448, 448)
    kv = kv.to(torch.float8_e4m3fn)
    q_nope = torch.randn(T, heads, dn, device=DEV, generator=gd).to(dtype)
    q_pe = torch.randn(T, heads, R, device=DEV, generator=gd).to(dtype)
    c_kv = torch.randn(T, L, device=DEV, generator=gd).to(dtype)
    k_pe = torch.randn(T, 1, R, device=DEV, generator=gd).to(dtype)
    w_kv_b = (torch.randn(heads * (dn + dv), L, device=DEV, generator=gd) * L ** -0.5).to(dtype)
    scale = (dn + R) ** -0.5
    kv_ref = kv.clone()
    ref = K._ref.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref,
                               batch, scale=scale, absorb="decode", kv_scale=kv_scale)
    out = K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode", kv_scale)
    assert out.shape == (T, heads * dv) and out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)
