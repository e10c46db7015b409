"""The Triton MoE (grouped GEMM) and MLA (absorbed latent decode) kernels vs the CPU library, under the
interpreter.

Rendered as in test_triton_kernels.py; tile sizes are shrunk by monkeypatching so tiny shapes still take
several K steps, N tiles, expert blocks, head blocks and split-KV partitions. Tolerances:
- moe_experts fp32: 1e-5 of the CPU library (different GEMM summation order). bf16: 2e-2 absolute + 2e-2
  relative of the CPU library on the same bf16 inputs: both round gate, up, silu, the product and the down
  projection to bf16 at the same points, but the CPU library also sums the k weighted results in bf16 (the
  kernel sums in fp32 and rounds once) and the interpreter converts fp32 -> bf16 by truncation.
- mla_attention fp32: 2e-5 of the CPU library. bf16: 3e-2 absolute of an fp32 CPU reference on the same
  bf16 inputs (q_lat and the latent output rounded to bf16 as the CPU library does, P rounded to bf16 for PV).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import mla_inputs, render_kernels  # noqa: E402
from test_triton_kernels import _batch  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("triton_moe_mla"))


@pytest.fixture(scope="module")
def R(K):
    return K._ref


@pytest.fixture
def small_tiles(K, monkeypatch):
    monkeypatch.setattr(K, "MOE_BLOCK_N", 16)
    monkeypatch.setattr(K, "MOE_BLOCK_K", 16)
    monkeypatch.setattr(K, "MLA_BLOCK_N", 16)


# ---------------------------------------------------------------- MoE


def _moe_inputs(T, E, H, F, top_k, dtype, g, experts=None):
    """x, fp32 routing weights, int32 ids (top_k distinct experts per token, drawn from `experts`)."""
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, top_k, generator=g), dim=-1)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * F, H, generator=g) * H ** -0.5).to(dtype)
    w_down = (torch.randn(E, H, F, generator=g) * F ** -0.5).to(dtype)
    return x, weights, ids, w_gate_up, w_down


def _moe_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,top_k,experts", [
    (1, 1, None),  # one token, top-1: one used block, the other experts idle
    (1, 2, None),
    (7, 2, [0, 2, 5]),  # experts 1, 3, 4 receive nothing
    (21, 2, [1, 4]),  # 21 rows per expert: two blocks of 16 each
], ids=["single-top1", "single-top2", "idle-experts", "multi-block"])
def test_moe_experts_matches_cpu(K, R, small_tiles, dtype, id_dtype, T, top_k, experts):
    g = torch.Generator().manual_seed(T * 10 + top_k)
    x, weights, ids, w_gate_up, w_down = _moe_inputs(T, 6, 40, 24, top_k, dtype, g, experts)
    ids = ids.to(id_dtype)
    _moe_close(K.moe_experts(x, weights, ids, w_gate_up, w_down), R.moe_experts(x, weights, ids, w_gate_up, w_down),
               dtype)


def test_moe_align_blocks_hold_one_expert(K):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 0]], dtype=torch.int32)
    sorted_pairs, block_expert = K.moe_align(ids, num_experts=5, block_m=2)
    assert block_expert.tolist() == [0, 0, 1, 3, 3, -1, -1, -1, -1]  # 4 + 5 blocks bound; 2 + 1 + 2 used
    pad = ids.numel()
    assert sorted_pairs.view(-1, 2)[:5].tolist() == [[1, 4], [7, pad], [3, pad], [0, 2], [5, 6]]
    assert (sorted_pairs.view(-1, 2)[5:] == pad).all()


def test_moe_separate_gate_up_weights_fall_back_to_torch(K, R):
    g = torch.Generator().manual_seed(5)
    x, weights, ids, w_gate_up, w_down = _moe_inputs(3, 4, 16, 8, 2, torch.float32, g)
    w_gate, w_up = w_gate_up[:, :8].contiguous(), w_gate_up[:, 8:].contiguous()
    assert torch.equal(K.moe_experts(x, weights, ids, w_gate, w_up, w_down),
                       R.moe_experts(x, weights, ids, w_gate, w_up, w_down))


# ---------------------------------------------------------------- MLA


def _check_mla(K, R, seqs, *, heads, dtype, partition, lora=32, rope_dim=8, dn=8, dv=8, block_size=4):
    g = torch.Generator().manual_seed(sum(c * 31 + n for c, n in seqs) + heads)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, block_size, lora + rope_dim, generator=g).to(dtype)
    q_nope, q_pe, c_kv, k_pe, w_kv_b = mla_inputs(T, heads, lora, rope_dim, dn, dv, dtype, g)
    scale = (dn + rope_dim) ** -0.5
    kv_ref = kv.clone().float()
    ref = R.mla_attention(q_nope.float(), q_pe.float(), c_kv.float(), k_pe.float(), w_kv_b.float(), kv_ref, batch,
                          scale=scale, absorb="decode")
    out = K.mla_attention(q_nope, q_pe, c_kv, k_pe, w_kv_b, kv, batch, scale, "decode", partition_size=partition)
    assert out.shape == (T, heads * dv) and out.dtype == dtype
    assert torch.equal(kv.float(), kv_ref.to(dtype).float()), "latents written to the wrong slots"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)
    return batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 20], ids=["one-head-block", "two-head-blocks"])
def test_mla_decode_split_kv(K, R, small_tiles, dtype, heads):
    # partitions of 32 tokens: contexts of 37 (2 partitions), 65 (3: 64 + 1), 7, 1 token
    _check_mla(K, R, [(36, 1), (64, 1), (6, 1), (0, 1)], heads=heads, dtype=dtype, partition=32)
    _check_mla(K, R, [(40, 1), (2, 1)], heads=heads, dtype=dtype, partition=None)  # one partition: no reduce


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_mixed_decodes_and_prefills(K, R, small_tiles, dtype):
    # 2 decodes on the kernel; a chunk continuing 13 cached tokens and a fresh prompt on the torch path
    batch = _check_mla(K, R, [(20, 1), (5, 1), (13, 9), (0, 11)], heads=4, dtype=dtype, partition=16)
    assert batch.num_decodes == 2


def test_mla_absorb_none_and_prefill_only_run_torch(K, R):
    g = torch.Generator().manual_seed(9)
    batch = _batch([(3, 1), (0, 4)], 4, 6, g)
    args = (torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 32, generator=g),
            torch.randn(5, 1, 8, generator=g), torch.randn(2 * 16, 32, generator=g))
    kv = torch.randn(6, 4, 40, generator=g)
    kv_ref = kv.clone()
    out = K.mla_attention(*args, kv, batch, 0.25, "none")
    assert torch.equal(out, R.mla_attention(*args, kv_ref, batch, scale=0.25, absorb="none"))
    assert torch.equal(kv, kv_ref)


# ---------------------------------------------------------------- end to end: a DeepSeek-V3 h200 artifact on CPU


def test_h200_deepseek_artifact_matches_cpu_artifact(tiny_checkpoint, tmp_path):
    """Tiny DeepSeek-V3 (MLA absorbed decodes, MoE layers) compiled for h200 selects the Triton MoE and MLA
    kernels, and under the interpreter gives the cpu artifact's greedy tokens and prompt logprobs."""
    import kiln
    from kiln.cli import main

    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint("deepseek_v3")), "-o", str(recipe)]) == 0
    kiln.compile(recipe, tmp_path / "cpu", progress=False)
    res = kiln.compile(recipe, tmp_path / "h200", target="h200", progress=False)
    assert {"triton.moe_experts", "triton.mla_attention"} <= set(res.manifest["kernels"])
    prompts = [list(range(5, 17)), [20, 30, 40]]
    params = kiln.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    ref = kiln.LLM(str(tmp_path / "cpu")).generate(prompts, params)
    got = kiln.LLM(str(tmp_path / "h200")).generate(prompts, params)
    for r, o in zip(ref, got, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        lp = lambda out: torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])  # noqa: E731
        torch.testing.assert_close(lp(o), lp(r), atol=1e-4, rtol=0)
