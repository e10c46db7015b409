"""linear_fp8 with static activation scales (fp8(act=static)) in the Triton library on a CUDA GPU: torch._scaled_mm
with the scalar input scale (tensor-wise scales for a per-tensor weight, row-wise for a per-channel/merged one) vs
the op table's reference on the same device.

The reference quantizes x with the same scale to the same e4m3 values and multiplies them exactly in fp32, so
only cuBLASLt's summation order and the bf16 output rounding differ: max error within 1% of the output's
largest magnitude. The scale is 0.7x absmax(x) / 448, so the largest activations saturate (the clamp is part
of the contract). Not yet run on a GPU.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from kiln.compiler.quant import fp8_quantize  # noqa: E402

DEV = "cuda"


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(128, 32, 8, 16)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_linear_fp8_static_scaled_mm(K, granularity, dtype, m):
    n, k = 6144, 4096
    g = torch.Generator(device=DEV).manual_seed(m + n)
    w_q, w_s = fp8_quantize(torch.randn(n, k, generator=g, device=DEV) * 0.02, granularity)
    x = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    x_scale = (0.7 * x.float().abs().amax() / 448.0).reshape(1)
    bias = torch.randn(n, generator=g, device=DEV).to(dtype)
    out = K.linear_fp8(x, w_q, w_s, x_scale, bias, granularity=granularity, block=0, act="static_per_tensor")
    ref = OPS["linear_fp8"].reference(RefContext(positions=torch.zeros(0, dtype=torch.int64)), x.float(), w_q,
                                      w_s, x_scale, bias.float(), granularity=granularity, block=0,
                                      act="static_per_tensor")
    assert out.dtype == dtype and out.shape == (m, n) and out.is_cuda
    err = (out.float() - ref).abs().max()
    assert err <= 1e-2 * ref.abs().max(), f"max error {err:.4g}"
