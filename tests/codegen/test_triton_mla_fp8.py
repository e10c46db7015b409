"""The Triton MLA absorbed decode over an fp8 latent cache, under the interpreter: the kernel reads e4m3
latents and folds the layer's one scale into the scores and the output, so it must equal the CPU library's
torch path (dequantize the gathered latent, then attend) on the same fp8 cache; the latent write stores
x / scale in e4m3 exactly as the CPU library does."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import mla_inputs, render_kernels  # noqa: E402
from test_triton_kernels import _batch  # noqa: E402


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("triton_mla_fp8"))


@pytest.fixture
def launches(K, monkeypatch):
    """Counts the latent decode kernel's launches (a silent torch fallback would pass the numerics)."""
    calls = []
    launch = K._launch_mla_decode
    monkeypatch.setattr(K, "MLA_BLOCK_N", 16)
    monkeypatch.setattr(K, "_launch_mla_decode", lambda *a, **kw: (calls.append(a[7] if len(a) > 7 else None),
                                                                   launch(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs,partition", [([(36, 1), (64, 1), (6, 1), (0, 1)], 32),  # split-KV + reduce
                                            ([(20, 1), (5, 1), (13, 9), (0, 11)], None)],  # decodes + prefills
                         ids=["split", "mixed"])
def test_fp8_latent_decode_matches_cpu_library(K, launches, dtype, seqs, partition):
    R = K._ref
    heads, lora, rope_dim, dn, dv, block_size = 20, 32, 8, 8, 8, 4
    g = torch.Generator().manual_seed(len(seqs) + heads)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    kv_scale = torch.tensor([3.0 / 448])  # latents of magnitude up to ~3 use the full e4m3 range
    kv = (torch.randn(num_blocks, block_size, lora + rope_dim, generator=g) / kv_scale).clamp(-448, 448)
    kv = kv.to(torch.float8_e4m3fn)
    q_nope, q_pe, c_kv, k_pe, w_kv_b = mla_inputs(T, heads, lora, rope_dim, dn, dv, dtype, g)
    scale = (dn + rope_dim) ** -0.5
    kv_ref = kv.clone()
    ref = R.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref, batch,
                          scale=scale, absorb="decode", kv_scale=kv_scale)
    out = K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode", kv_scale,
                          partition_size=partition)
    assert launches == [kv_scale], "the fp8 latent decode fell back to torch (or ran without its scale)"
    assert out.shape == (T, heads * dv) and out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8)), "latent write differs from the CPU library"
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:  # the bf16 latent rounds before it is quantized: at most one e4m3 step apart
        diff = (kv.float() - kv_ref.float()).abs()
        assert float((diff > 0).float().mean()) < 0.05 and float(diff.max()) <= 32
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)
    # the scale matters: the same fp8 bytes read without it (scale 1) give a different answer
    plain = R.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(),
                            kv_ref.float(), batch, scale=scale, absorb="decode")
    assert float((plain[: batch.num_decodes] - ref[: batch.num_decodes]).abs().max()) > 0.1
