"""The h100/h200 Triton kernel library vs the CPU library, under Triton's CPU interpreter.

The kernels module is rendered from codegen/templates/triton/kernels.py.j2 into a package beside the CPU
library (its torch fallback), exactly as in an artifact. Shapes are tiny: the interpreter runs every program
instance in Python. Tolerances: fp32 outputs within 1e-5 of the CPU library (attention 2e-5: a different
summation order); bf16 elementwise kernels within a few bf16 ulps (4e-2 absolute on O(1) values; they round at the same points as torch,
but triton 3.6's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even as on a GPU);
bf16 attention within 2e-2 absolute of an fp32 reference on the same bf16 inputs (P is rounded to bf16
before PV, as on tensor cores).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecations inside the interpreter

from codegen_helpers import render_kernels  # noqa: E402
from kiln.runtime.forward_batch import ForwardBatch  # noqa: E402


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("triton_kernels"))


@pytest.fixture(scope="module")
def R(K):
    return K._ref


def _ulp_close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:  # a few bf16 ulps of O(1) values: the interpreter truncates at each of up to three rounding points
        torch.testing.assert_close(a.float(), b.float(), atol=4e-2, rtol=2 ** -6)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(K, R, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype)
    r = torch.randn(5, 48, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    _ulp_close(K.rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5), dtype)
    out, summed = K.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_sum = R.add_rms_norm(x, r, w, 1e-6)
    _ulp_close(summed, ref_sum, dtype)
    _ulp_close(out, ref_out, dtype)
    x3 = torch.randn(2, 3, 48, generator=g).to(dtype)[:, 1:]  # strided rows
    _ulp_close(K.rms_norm(x3, w, 1e-5), R.rms_norm(x3, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_embedding(K, R, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2 * 40, generator=g).to(dtype)
    _ulp_close(K.silu_mul(x), R.silu_mul(x), dtype)
    table = torch.randn(50, 24, generator=g).to(dtype)
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int32)
    assert torch.equal(K.embedding(ids, table), R.embedding(ids, table))


@pytest.mark.parametrize("rotary_dim", [0, 12], ids=["full", "partial"])  # partial: 12 of 16 dims (Phi-4-mini's 3/4)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_rope_kv_write(K, R, dtype, rotary_dim):
    g = torch.Generator().manual_seed(2)
    cache = K.rope_cache(16, 64, 10000.0, rotary_dim=rotary_dim)
    qkv = torch.randn(5, (8 + 2 + 2) * 16, generator=g).to(dtype)
    q = qkv[:, :128].unflatten(-1, (8, 16))  # strided views, as model.py passes them
    k = qkv[:, 128:160].unflatten(-1, (2, 16))
    v = qkv[:, 160:].unflatten(-1, (2, 16))
    pos = torch.tensor([0, 7, 8, 31, 63], dtype=torch.int32)
    _ulp_close(K.rope(q, pos, cache), R.rope(q, pos, cache), dtype)
    slots = torch.tensor([5, 0, 13, -1, 2], dtype=torch.int64)  # -1: padding token, not stored
    kv = torch.zeros(4, 2, 4, 2, 16, dtype=dtype)
    K.rope_kv_write(k, v, pos, cache, kv, slots)
    ref = torch.zeros_like(kv)
    keep = slots >= 0
    R.write_kv_cache(R.rope(k, pos, cache)[keep], v[keep], ref, slots[keep])
    _ulp_close(kv, ref, dtype)
    kv2 = torch.zeros_like(kv)
    K.write_kv_cache(k, v, kv2, slots)
    ref2 = torch.zeros_like(kv)
    R.write_kv_cache(k[keep], v[keep], ref2, slots[keep])
    assert torch.equal(kv2, ref2)


# ---------------------------------------------------------------- paged attention


def _batch(seqs, block_size, num_blocks, g):
    """seqs: [(cached, new)] with decodes (new == 1) first. Random physical blocks; returns the ForwardBatch."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, positions, qsl, seq_lens = [], [], [], [0], []
    for cached, new in seqs:
        total = cached + new
        n_blocks = -(-total // block_size)
        table, perm = perm[:n_blocks], perm[n_blocks:]
        tables.append(table)
        for p in range(cached, total):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    width = max(len(t) for t in tables)
    bt = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    num_decodes = 0
    for cached, new in seqs:
        if new != 1 or cached == 0:
            break
        num_decodes += 1
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return ForwardBatch(input_ids=torch.zeros(qsl[-1], dtype=torch.int32), positions=i32(positions),
                        query_start_loc=i32(qsl), seq_lens=i32(seq_lens), block_tables=bt,
                        slot_mapping=torch.tensor(slots, dtype=torch.int64),
                        logits_indices=i32([e - 1 for e in qsl[1:]]), num_decodes=num_decodes)


def _check_attention(K, R, seqs, *, heads, kv_heads, dtype, window=0, block_size=4, head_dim=16, partition=None):
    g = torch.Generator().manual_seed(sum(c * 31 + n for c, n in seqs) + heads)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    kv_ref = kv.clone().float()
    ref = R.paged_attention(q.float(), k.float(), v.float(), kv_ref, batch, scale=scale, sliding_window=window)
    out = K.paged_attention(q, k, v, kv, batch, scale, window, partition_size=partition)
    assert out.shape == (T, heads * head_dim) and out.dtype == dtype
    assert torch.equal(kv.float(), kv_ref.to(dtype).float()), "K/V written to the wrong slots"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (2, 2)], ids=["gqa4", "mha"])
def test_decode_split_kv(K, R, monkeypatch, dtype, heads, kv_heads):
    monkeypatch.setattr(K, "BLOCK_N", 16)
    # partitions of 32 tokens: contexts of 37 (2 partitions), 65 (3: 64 + 1), 7 tokens; then a 1-token prompt
    _check_attention(K, R, [(36, 1), (64, 1), (6, 1), (0, 1)], heads=heads, kv_heads=kv_heads,
                     dtype=dtype, partition=32)
    _check_attention(K, R, [(40, 1), (2, 1)], heads=heads, kv_heads=kv_heads, dtype=dtype, partition=None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_decode_and_prefill_with_cached_prefix(K, R, monkeypatch, dtype):
    monkeypatch.setattr(K, "BLOCK_N", 16)
    monkeypatch.setattr(K, "BLOCK_Q", 4)  # several query tiles per prompt, tiles straddling sequences
    # 2 decodes, a chunk continuing 13 cached tokens, a fresh prompt, a 1-token chunk after a prefix
    _check_attention(K, R, [(20, 1), (5, 1), (13, 9), (0, 11), (7, 3)], heads=8, kv_heads=2,
                     dtype=dtype, partition=16)


@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window(K, R, monkeypatch, window):
    monkeypatch.setattr(K, "BLOCK_N", 16)
    monkeypatch.setattr(K, "BLOCK_Q", 2)
    _check_attention(K, R, [(50, 1), (3, 1), (21, 12), (0, 19)], heads=8, kv_heads=2, dtype=torch.float32,
                     window=window, partition=16)


def test_prefill_group_not_power_of_two_and_odd_head_dim(K, R, monkeypatch):
    monkeypatch.setattr(K, "BLOCK_N", 16)
    _check_attention(K, R, [(9, 1), (4, 7), (0, 5)], heads=6, kv_heads=2, dtype=torch.float32, head_dim=24,
                     block_size=8, partition=16)


def test_attention_falls_back_to_torch_for_unsupported_head_dim(K, R):
    batch = _batch([(0, 3)], 4, 2, torch.Generator().manual_seed(0))
    q, k, v = torch.randn(3, 1, 320), torch.randn(3, 1, 320), torch.randn(3, 1, 320)
    kv, kv_ref = torch.zeros(2, 2, 4, 1, 320), torch.zeros(2, 2, 4, 1, 320)
    out = K.paged_attention(q, k, v, kv, batch, 0.1)
    assert torch.equal(out, R.paged_attention(q, k, v, kv_ref, batch, scale=0.1))


# ---------------------------------------------------------------- sampling


def _reference_sample(logits, temperature, top_k, top_p, noise):
    from kiln.runtime.core.sampler import apply_top_k, apply_top_p

    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    x = apply_top_p(apply_top_k(x, top_k), top_p)
    sampled = (torch.softmax(x, dim=-1) / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def test_sample_greedy_exact_and_top_k_top_p(K):
    g = torch.Generator().manual_seed(3)
    B, V = 8, 300
    logits = torch.randn(B, V, generator=g) * 3
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: argmax takes the first index
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    top_k = torch.tensor([0, 0, 0, 5, 0, 40, 1, 17], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 0.5, 1.0, 0.95])
    for _ in range(3):
        noise = torch.empty(B, V).exponential_(generator=g)
        got = K.sample(logits, temperature, top_k, top_p, noise)
        assert got.tolist() == _reference_sample(logits, temperature, top_k, top_p, noise).tolist()
    assert K.sample(logits, temperature, top_k, top_p, noise)[1] == 7


# ---------------------------------------------------------------- end to end: an h200 artifact on CPU


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_h200_artifact_matches_cpu_artifact(arch, tiny_checkpoint, tmp_path):
    """`kiln compile --target h200` on a CPU machine; the artifact (triton kernels, run by the interpreter on
    CPU tensors) gives the cpu artifact's greedy tokens, also with chunked prefill continuing cached chunks."""
    import kiln
    from kiln.cli import main

    ckpt = tiny_checkpoint(arch)
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    kiln.compile(recipe, tmp_path / "cpu", progress=False)
    res = kiln.compile(recipe, tmp_path / "h200", target="h200", progress=False)
    assert res.manifest["target"] == "h200" and "triton.paged_attention" in res.manifest["kernels"]
    assert (tmp_path / "h200" / "kernels" / "triton.py").is_file()
    assert "from .kernels import triton as K" in (tmp_path / "h200" / "model.py").read_text()

    prompts = [list(range(5, 25)), [20, 30, 40]]  # 20 + 6 tokens: past mistral's window of 16
    params = kiln.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    ref = kiln.LLM(str(tmp_path / "cpu")).generate(prompts, params)
    got = kiln.LLM(str(tmp_path / "h200"), chunked_prefill=5).generate(prompts, params)
    for r, o in zip(ref, got, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        lp = lambda out: torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])  # noqa: E731
        torch.testing.assert_close(lp(o), lp(r), atol=1e-4, rtol=0)


def test_h200_artifact_refuses_cpu_without_interpreter(tiny_checkpoint, tmp_path, monkeypatch):
    from kiln.runtime.errors import ArtifactError

    import kiln
    from kiln.cli import main

    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(recipe)]) == 0
    kiln.compile(recipe, tmp_path / "art", target="h200", progress=False)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ArtifactError, match="compiled for target 'h200'.*no CUDA device"):
        kiln.LLM(str(tmp_path / "art"))
