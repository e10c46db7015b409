"""The Triton kernel library on a CUDA GPU, vs the CPU library (torch) on the same device.

Shapes are Llama-3-8B-like (head_dim 128, 32 query / 8 KV heads, KV block 16). Tolerances: bf16 elementwise
kernels within one bf16 ulp of torch (they round at the same points; fp32 reductions may differ in order);
fp32 attention within 1e-4 of the fp32 reference (ieee dots, no tf32); bf16 attention within 1.5e-2 absolute
of an fp32 reference on the same bf16 inputs (P rounded to bf16 for PV, as on tensor cores); greedy sampling
exact; top-k/top-p sampling identical to the runtime Sampler's math on the same noise.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.forward_batch import ForwardBatch  # noqa: E402

DEV = "cuda"
HEAD_DIM, HEADS, KV_HEADS, BLOCK = 128, 32, 8, 16


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(HEAD_DIM, HEADS, KV_HEADS, BLOCK)


def _one_ulp(a, b):
    # Triton rounds once from fp32 where torch rounds at several points: one bf16 ulp apart, also near 0
    # (measured on the H200: 0.0078 absolute at |x| ~ 1, where one ulp is 2**-7).
    torch.testing.assert_close(a.float(), b.float(), atol=2 ** -7, rtol=2 ** -7)


def test_norms_silu_embedding_rope_bf16(K):
    R = K._ref
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(77, 4096, device=DEV, generator=g).bfloat16()
    r = torch.randn(77, 4096, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    _one_ulp(K.rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5))
    out, summed = K.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_sum = R.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, ref_sum)
    _one_ulp(out, ref_out)
    gu = torch.randn(77, 2 * 14336, device=DEV, generator=g).bfloat16()
    _one_ulp(K.silu_mul(gu), R.silu_mul(gu))
    table = torch.randn(1000, 4096, device=DEV, generator=g).bfloat16()
    ids = torch.randint(0, 1000, (77,), device=DEV, generator=g, dtype=torch.int32)
    assert torch.equal(K.embedding(ids, table), R.embedding(ids, table))
    cache = K.rope_cache(HEAD_DIM, 8192, 500000.0).to(DEV)
    q = torch.randn(77, HEADS, HEAD_DIM, device=DEV, generator=g).bfloat16()
    pos = torch.randint(0, 8192, (77,), device=DEV, generator=g, dtype=torch.int32)
    _one_ulp(K.rope(q, pos, cache), R.rope(q, pos, cache))


def _batch(seqs, num_blocks, g):
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, positions, qsl, seq_lens = [], [], [], [0], []
    for cached, new in seqs:
        total = cached + new
        n = -(-total // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        positions += list(range(cached, total))
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    bt = torch.full((len(seqs), max(map(len, tables))), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    num_decodes = next((i for i, (c, n) in enumerate(seqs) if n != 1 or c == 0), len(seqs))

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=DEV)

    return ForwardBatch(input_ids=i32([0] * qsl[-1]), positions=i32(positions), query_start_loc=i32(qsl),
                        seq_lens=i32(seq_lens), block_tables=bt.to(DEV),
                        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
                        logits_indices=i32([e - 1 for e in qsl[1:]]), num_decodes=num_decodes)


CASES = {
    "decode_split": [(1023, 1)] * 3 + [(3000, 1), (17, 1)],
    "decode_many": [(200 + 7 * i, 1) for i in range(48)],  # enough (seq, KV head) programs: no split
    "mixed_prefix_chunks": [(511, 1), (90, 1), (1000, 300), (0, 257), (48, 16)],
    "prefill_4k": [(0, 4096)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 256])
def test_paged_attention(K, dtype, case, window):
    seqs = CASES[case]
    g = torch.Generator().manual_seed(hash(case) % 1000 + window)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 5
    batch = _batch(seqs, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(DEV, dtype)
    q, k, v = (torch.randn(T, h, HEAD_DIM, generator=g).to(DEV, dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    kv_ref = kv.float().clone()
    ref = K._ref.paged_attention(q.float(), k.float(), v.float(), kv_ref, batch, scale=HEAD_DIM ** -0.5,
                                 sliding_window=window)
    out = K.paged_attention(q, k, v, kv, batch, HEAD_DIM ** -0.5, window)
    torch.cuda.synchronize()
    assert torch.equal(kv.float(), kv_ref.to(dtype).float())
    assert not out.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)


def test_sample(K):
    from kiln.runtime.core.sampler import apply_top_k, apply_top_p

    g = torch.Generator(device=DEV).manual_seed(3)
    B, V = 64, 128256
    logits = torch.randn(B, V, device=DEV, generator=g) * 4
    temperature = torch.rand(B, device=DEV, generator=g) + 0.3
    temperature[:16] = 0.0
    top_k = torch.randint(0, 100, (B,), device=DEV, generator=g, dtype=torch.int32)
    top_p = torch.where(torch.rand(B, device=DEV, generator=g) < 0.5, 1.0, 0.9)
    noise = torch.empty(B, V, device=DEV).exponential_(generator=g)
    got = K.sample(logits, temperature, top_k, top_p, noise)
    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    x = apply_top_p(apply_top_k(x, top_k), top_p)
    ref = torch.where(greedy, logits.argmax(-1), (torch.softmax(x, -1) / noise).argmax(-1))
    assert torch.equal(got[:16], logits[:16].argmax(-1))
    mismatches = (got != ref).sum().item()
    assert mismatches <= 1, f"{mismatches} of {B} rows differ from the reference sampler"  # boundary rounding
