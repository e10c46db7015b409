"""The Triton MoE and MLA-decode kernels on a CUDA GPU, vs the CPU library (torch) on the same device.

Shapes are DeepSeek-like, cut down so the file runs in seconds: 64 experts (top-8 and top-2), hidden 1024,
expert width 512; MLA with kv_lora_rank 512, rope 64, qk_nope / v head dims 128, 16 and 128 heads, KV block 16.
Tolerances: moe_experts fp32 within 1e-4 (ieee dots, a different summation order), bf16 within 2e-2 absolute +
2e-2 relative of the CPU library on the same bf16 inputs (same rounding points; the CPU library also sums the
top-k results in bf16). mla_attention fp32 within 1e-4 of the CPU library, bf16 within 3e-2 absolute of an fp32
reference on the same bf16 inputs (P rounded to bf16 for PV, as on tensor cores).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.forward_batch import ForwardBatch  # noqa: E402

DEV = "cuda"
BLOCK = 16
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(128, 1, 1, BLOCK)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,top_k,num_used", [(1, 8, 64), (1, 2, 64), (37, 8, 64), (300, 2, 5)],
                         ids=["decode-top8", "decode-top2", "batch-top8", "crowded-few-experts"])
def test_moe_experts(K, dtype, id_dtype, T, top_k, num_used):
    E, H, F = 64, 1024, 512
    g = torch.Generator(device=DEV).manual_seed(T + top_k)
    used = torch.randperm(E, device=DEV, generator=g)[:num_used]  # the others stay idle
    ids = torch.stack([used[torch.randperm(num_used, device=DEV, generator=g)[:top_k]] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, top_k, device=DEV, generator=g), dim=-1)
    x = torch.randn(T, H, device=DEV, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * F, H, device=DEV, generator=g) * H ** -0.5).to(dtype)
    w_down = (torch.randn(E, H, F, device=DEV, generator=g) * F ** -0.5).to(dtype)
    ids = ids.to(id_dtype)
    out = K.moe_experts(x, weights, ids, w_gate_up, w_down)
    ref = K._ref.moe_experts(x, weights, ids, w_gate_up, w_down)
    assert out.dtype == dtype and out.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _batch(seqs, num_blocks, g):
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl, seq_lens = [], [], [0], []
    for cached, new in seqs:
        total = cached + new
        n = -(-total // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    bt = torch.full((len(seqs), max(len(t) for t in tables)), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    num_decodes = next((i for i, (c, n) in enumerate(seqs) if n != 1 or c == 0), len(seqs))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    return ForwardBatch(input_ids=torch.zeros(qsl[-1], dtype=torch.int32, device=DEV), positions=i32([0] * qsl[-1]),
                        query_start_loc=i32(qsl), seq_lens=i32(seq_lens), block_tables=bt.to(DEV),
                        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
                        logits_indices=i32([e - 1 for e in qsl[1:]]), num_decodes=num_decodes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("seqs,partition", [
    ([(999, 1), (36, 1), (2048, 1), (0, 1)], 256),  # split-KV: contexts not multiples of block or partition
    ([(999, 1), (36, 1)], 4096),  # one partition: no reduce pass
    ([(700, 1), (5, 1), (130, 77), (0, 40)], None),  # decodes on the kernel, prefills on torch
], ids=["split", "single-partition", "mixed"])
def test_mla_decode(K, dtype, heads, seqs, partition):
    L, R, dn, dv = 512, 64, 128, 128
    g = torch.Generator().manual_seed(heads + len(seqs))
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 3
    batch = _batch(seqs, num_blocks, g)
    T = batch.num_tokens
    gd = torch.Generator(device=DEV).manual_seed(7)
    kv = torch.randn(num_blocks, BLOCK, L + R, device=DEV, generator=gd).to(dtype)
    q_nope = torch.randn(T, heads, dn, device=DEV, generator=gd).to(dtype)
    q_pe = torch.randn(T, heads, R, device=DEV, generator=gd).to(dtype)
    c_kv = torch.randn(T, L, device=DEV, generator=gd).to(dtype)
    k_pe = torch.randn(T, 1, R, device=DEV, generator=gd).to(dtype)
    w_kv_b = (torch.randn(heads * (dn + dv), L, device=DEV, generator=gd) * L ** -0.5).to(dtype)
    scale = (dn + R) ** -0.5
    kv_ref = kv.clone().float()
    ref = K._ref.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref,
                               batch, scale=scale, absorb="decode")
    out = K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode", partition_size=partition)
    assert out.shape == (T, heads * dv) and out.dtype == dtype
    assert torch.equal(kv.float(), kv_ref.to(dtype).float())
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)
