"""Autotuned decode kernels inside CUDA graphs, on a CUDA GPU.

As the graph runner does: one eager call per bucket (which times the candidate configs and caches the choice
under a key without sequence lengths), then capture, then replays with other context lengths written into
the static buffers. Each replay is checked against the torch reference (the CPU library / op table on the
same device), and the capture must not have re-tuned. Shapes: Llama-8B-like paged attention (32 query / 8 KV
heads, head_dim 128), DeepSeek-like MLA (128 heads, latent 512 + rope 64), an int4 AWQ 4096x4096 GEMM.
Tolerances as in the other tests/gpu kernel files: attention bf16 within 2e-2 (MLA 3e-2) absolute of an fp32
reference; the GEMM within 1% of the output's largest magnitude (same bf16 weight, fp32 summation order).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.compiler.ops import OPS, RefContext  # noqa: E402
from kiln.runtime.forward_batch import ForwardBatch  # noqa: E402

DEV = "cuda"
BLOCK = 16
WIDTH = 64  # block-table columns: contexts up to 1024 tokens


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    mod = render_triton_kernels(128, 32, 8, BLOCK)
    mod.AUTOTUNE = True  # off for the rest of tests/gpu (conftest); on by default in an artifact on a GPU
    return mod


def _static_batch(bs: int) -> ForwardBatch:
    """Decode-only static buffers (as the graph runner's), rows own disjoint blocks 0..bs*WIDTH-1."""
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32, device=DEV)  # noqa: E731
    bt = torch.arange(bs * WIDTH, dtype=torch.int32, device=DEV).view(bs, WIDTH)
    return ForwardBatch(input_ids=i32(bs), positions=i32(bs),
                        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=DEV), seq_lens=i32(bs) + 1,
                        block_tables=bt, slot_mapping=torch.zeros(bs, dtype=torch.int64, device=DEV),
                        logits_indices=torch.arange(bs, dtype=torch.int32, device=DEV), num_decodes=bs)


def _set_contexts(batch: ForwardBatch, lens: list[int]) -> None:
    """New context lengths (this step's token included) written into the static buffers."""
    t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    batch.seq_lens.copy_(t)
    batch.positions.copy_(t - 1)
    rows = torch.arange(len(lens), device=DEV)
    batch.slot_mapping.copy_(batch.block_tables[rows, (t - 1) // BLOCK].long() * BLOCK + ((t - 1) % BLOCK))


def _graph(fn):
    fn()  # the graph runner's eager run: tunes
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _decode_case(bs=4, H=32, KVH=8, D=128):
    batch = _static_batch(bs)
    gd = torch.Generator(device=DEV).manual_seed(0)
    kv = torch.randn(bs * WIDTH + 1, 2, BLOCK, KVH, D, device=DEV, generator=gd).to(torch.bfloat16)
    q = torch.randn(bs, H, D, device=DEV, generator=gd).to(torch.bfloat16)
    k = torch.randn(bs, KVH, D, device=DEV, generator=gd).to(torch.bfloat16)
    v = torch.randn(bs, KVH, D, device=DEV, generator=gd).to(torch.bfloat16)
    return batch, kv, q, k, v


def test_paged_decode_attention_every_config(K):
    batch, kv, q, k, v = _decode_case()
    _set_contexts(batch, [1000, 17, 513, 1])
    for cfg in [K._decode_default()] + K.DECODE_CONFIGS:
        kv_ref = kv.float()
        out = K.paged_attention(q, k, v, kv, batch, 128 ** -0.5, config=cfg)
        ref = K._ref.paged_attention(q.float(), k.float(), v.float(), kv_ref, batch, scale=128 ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0, msg=lambda m, c=cfg: f"{c}: {m}")


def test_paged_decode_attention_tuned_then_graphed(K):
    bs, H, KVH, D = 4, 32, 8, 128
    batch, kv, q, k, v = _decode_case(bs, H, KVH, D)
    graph, out = _graph(lambda: K.paged_attention(q, k, v, kv, batch, D ** -0.5))
    tuned = {k_: c for k_, c in K.tuned_configs().items() if k_.startswith("decode ")}
    assert len(tuned) == 1, tuned
    for lens in ([1000, 17, 513, 1], [64, 1024, 300, 2]):
        _set_contexts(batch, lens)
        kv_ref = kv.float()
        graph.replay()
        ref = K._ref.paged_attention(q.float(), k.float(), v.float(), kv_ref, batch, scale=D ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    assert {k_: c for k_, c in K.tuned_configs().items() if k_.startswith("decode ")} == tuned


def _mla_case(bs=2, H=128, L=512, R=64, dn=128, dv=128):
    batch = _static_batch(bs)
    gd = torch.Generator(device=DEV).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device=DEV, generator=gd).to(torch.bfloat16)  # noqa: E731
    kv = rnd(bs * WIDTH + 1, BLOCK, L + R)
    q_nope, q_pe, c_kv, k_pe = rnd(bs, H, dn), rnd(bs, H, R), rnd(bs, L), rnd(bs, 1, R)
    w_kv_b = (torch.randn(H * (dn + dv), L, device=DEV, generator=gd) * L ** -0.5).to(torch.bfloat16)
    return batch, kv, (q_nope, q_pe, c_kv, k_pe, w_kv_b), (dn + R) ** -0.5


def test_mla_decode_every_config(K):
    batch, kv, args, scale = _mla_case()
    _set_contexts(batch, [1000, 3])
    for cfg in [K._mla_default()] + K.MLA_CONFIGS:
        kv_ref = kv.float()
        out = K.mla_attention(*args, kv, batch, scale, "decode", config=cfg)
        ref = K._ref.mla_attention(*(a.float() for a in args), kv_ref, batch, scale=scale, absorb="decode")
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0, msg=lambda m, c=cfg: f"{c}: {m}")


def test_mla_decode_tuned_then_graphed(K):
    batch, kv, (q_nope, q_pe, c_kv, k_pe, w_kv_b), scale = _mla_case()
    graph, out = _graph(lambda: K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode"))
    tuned = {k_: c for k_, c in K.tuned_configs().items() if k_.startswith("mla_decode ")}
    assert len(tuned) == 1, tuned
    for lens in ([1000, 3], [129, 1024]):
        _set_contexts(batch, lens)
        kv_ref = kv.float()
        graph.replay()
        ref = K._ref.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref,
                                   batch, scale=scale, absorb="decode")
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("m", [1, 8])
def test_wq_gemm_tuned_then_graphed(K, m):
    n = k = 4096
    group = 128
    g = torch.Generator().manual_seed(m)
    words = lambda *s: torch.randint(-2**31, 2**31 - 1, s, generator=g, dtype=torch.int64).to(torch.int32)  # noqa: E731
    qweight, qzeros = words(k, n // 8).to(DEV), words(k // group, n // 8).to(DEV)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(torch.float16).to(DEV)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    graph, out = _graph(lambda: K.wq_gemm(x, qweight, qzeros, scales, None, None, format="awq", group=group))
    assert any(key.startswith(f"wq_gemm {m} {n} {k} awq") for key in K.tuned_configs())
    for _ in range(2):
        x.copy_(torch.randn(m, k, generator=g).to(torch.bfloat16))
        graph.replay()
        ref = OPS["linear_w4a16"].reference(RefContext(positions=torch.zeros(0, dtype=torch.int64)), x, qweight,
                                            qzeros, scales, format="awq", group=group, zero_offset=0)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 0.01 * ref.float().abs().max().item(), err
