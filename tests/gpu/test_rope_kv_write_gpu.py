"""The fused rope + paged-KV write (fuse_rope_kv_write) on a CUDA GPU at Llama-3-8B shapes (head_dim 128, 32
query / 8 KV heads, KV block 16, Llama-3.1-scaled rope table).

References: the CPU library's `rope` then `write_kv_cache` / `paged_attention` on the same device. Tolerances:
roped q and cached K within one bf16 ulp of torch (the kernel rounds at the same points); attention within
1.5e-2 absolute of the fp32 reference on the bf16-roped inputs (as test_triton_kernels_gpu.py). The decode path
is also captured in a CUDA graph and replayed at new positions, as the runtime serves it.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_kernels_gpu import _batch  # noqa: E402

DEV = "cuda"
HEAD_DIM, HEADS, KV_HEADS, BLOCK = 128, 32, 8, 16


@pytest.fixture(scope="module")
def K(render_triton_kernels):
    return render_triton_kernels(HEAD_DIM, HEADS, KV_HEADS, BLOCK)


@pytest.fixture(scope="module")
def cache(K):
    return K.rope_cache(HEAD_DIM, 8192, 500000.0, scaling="llama3", factor=8.0).to(DEV)


def _one_ulp(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=2 ** -7, rtol=2 ** -7)


def test_rope_qk_kv_write_bf16(K, cache):
    R = K._ref
    g = torch.Generator(device=DEV).manual_seed(0)
    T = 77
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEV, generator=g).bfloat16()
    q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                                  KV_HEADS * HEAD_DIM], dim=-1))
    pos = torch.randint(0, 8192, (T,), device=DEV, generator=g, dtype=torch.int32)
    slots = torch.randperm(40 * BLOCK, device=DEV, generator=g)[:T]
    kv = torch.zeros(40, 2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    ref = torch.zeros_like(kv)
    q_rot = K.rope_qk_kv_write(q, k, v, pos, cache, kv, slots)
    R.write_kv_cache(R.rope(k, pos, cache), v, ref, slots)
    _one_ulp(q_rot, R.rope(q, pos, cache))
    _one_ulp(kv, ref)
    assert torch.equal(kv[:, 1], ref[:, 1])


def test_partial_rotary_longrope_kernels_bf16(K):
    """Phi-4-mini's rope (96 of 128 dims rotate, LongRoPE long factors: the table serves 8192 > 4096 positions):
    `rope`, `rope_kv_write` and `rope_qk_kv_write` against the torch library; the 32 other dims are copied."""
    R = K._ref
    table = K.rope_cache(HEAD_DIM, 8192, 10000.0, scaling="longrope", factor=32.0, original_max_position=4096,
                         rotary_dim=96, short_factor=tuple(1 + i / 50 for i in range(48)),
                         long_factor=tuple(1 + i for i in range(48))).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    T = 53
    q = torch.randn(T, HEADS, HEAD_DIM, device=DEV, generator=g).bfloat16()
    k, v = (torch.randn(T, KV_HEADS, HEAD_DIM, device=DEV, generator=g).bfloat16() for _ in range(2))
    pos = torch.randint(0, 8192, (T,), device=DEV, generator=g, dtype=torch.int32)
    slots = torch.randperm(40 * BLOCK, device=DEV, generator=g)[:T]
    ref = torch.zeros(40, 2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    R.write_kv_cache(R.rope(k, pos, table), v, ref, slots)
    roped = K.rope(q, pos, table)
    _one_ulp(roped, R.rope(q, pos, table))
    assert torch.equal(roped[..., 96:], q[..., 96:])
    kv = torch.zeros_like(ref)
    K.rope_kv_write(k, v, pos, table, kv, slots)
    _one_ulp(kv, ref)
    kv.zero_()
    _one_ulp(K.rope_qk_kv_write(q, k, v, pos, table, kv, slots), R.rope(q, pos, table))
    _one_ulp(kv, ref)
    assert torch.equal(kv[:, 1], ref[:, 1])


@pytest.mark.parametrize("seqs", [[(1023, 1)] * 3 + [(3000, 1)], [(511, 1), (1000, 300), (0, 257)]],
                         ids=["decode", "mixed"])
def test_paged_attention_with_fused_rope(K, cache, seqs):
    R = K._ref
    g = torch.Generator().manual_seed(len(seqs))
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 5
    batch = _batch(seqs, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(DEV, torch.bfloat16)
    q, k, v = (torch.randn(T, h, HEAD_DIM, generator=g).to(DEV, torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    kv_ref = kv.float().clone()
    pos = batch.positions
    ref = R.paged_attention(R.rope(q, pos, cache).float(), R.rope(k, pos, cache).float(), v.float(), kv_ref, batch,
                            scale=HEAD_DIM ** -0.5)
    out = K.paged_attention(q, k, v, kv, batch, HEAD_DIM ** -0.5, rope_cache=cache)
    torch.cuda.synchronize()
    _one_ulp(kv, kv_ref)
    torch.testing.assert_close(out.float(), ref, atol=1.5e-2, rtol=0)


def test_fused_decode_in_a_cuda_graph(K, cache):
    """Captured once, replayed after the step's positions, slots and q/k/v change in place: the replay equals an
    eager fused call on the new inputs."""
    g = torch.Generator().manual_seed(5)
    seqs = [(700 + 36 * i, 1) for i in range(8)]  # no context ends on a block boundary
    num_blocks = sum(-(-(c + n + 1) // BLOCK) for c, n in seqs) + 5
    batch = _batch(seqs, num_blocks, g)
    kv = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(DEV, torch.bfloat16)
    q, k, v = (torch.randn(8, h, HEAD_DIM, generator=g).to(DEV, torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))

    def step():
        return K.paged_attention(q, k, v, kv, batch, HEAD_DIM ** -0.5, rope_cache=cache)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=g).to(DEV, torch.bfloat16))
    batch.positions.add_(1)
    batch.seq_lens.add_(1)
    batch.slot_mapping.add_(1)  # the next slot of each sequence's last block (contexts end mid-block here)
    kv_eager = kv.clone()
    graph.replay()
    expected = K.paged_attention(q, k, v, kv_eager, batch, HEAD_DIM ** -0.5, rope_cache=cache)
    torch.cuda.synchronize()
    assert torch.equal(kv, kv_eager)
    assert torch.equal(out, expected)
