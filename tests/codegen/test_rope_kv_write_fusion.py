"""The fused rope + paged-KV write (fuse_rope_kv_write): the Triton `rope_qk_kv_write` kernel and
`paged_attention(..., rope_cache=)` under the interpreter, the generated model.py, and end to end.

References are the CPU library's separate `rope` then `paged_attention` (independent of the fused launcher)
and Hugging Face transformers. Tolerances as in test_triton_kernels.py: fp32 within 1e-5 (attention 2e-5),
bf16 within a few ulps (the interpreter truncates fp32 -> bf16).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import render_kernels  # noqa: E402
from test_triton_kernels import _batch, _ulp_close  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("rope_kv_write"))


@pytest.fixture(scope="module")
def R(K):
    return K._ref


# a table per rope shape: Llama-3.1 over whole heads; Phi-4-mini's LongRoPE over 12 of 16 dims (4 copied as they are)
TABLES = {
    "llama3": dict(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=16),
    "longrope_partial": dict(theta=10000.0, scaling="longrope", factor=4.0, original_max_position=16, rotary_dim=12,
                             short_factor=(1.0, 1.1, 1.3, 1.6, 2.0, 2.5), long_factor=(1.2, 1.9, 3.1, 5.0, 8.0, 12.5)),
}


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_kv_write_one_launch(K, R, dtype, table):
    g = torch.Generator().manual_seed(7)
    cache = R.rope_cache(16, 64, **TABLES[table])
    qkv = torch.randn(5, (8 + 2 + 2) * 16, generator=g).to(dtype)
    q = qkv[:, :128].unflatten(-1, (8, 16))  # strided views of one fused projection, as model.py passes them
    k = qkv[:, 128:160].unflatten(-1, (2, 16))
    v = qkv[:, 160:].unflatten(-1, (2, 16))
    pos = torch.tensor([0, 7, 8, 31, 63], dtype=torch.int32)
    slots = torch.tensor([5, 0, 13, -1, 2], dtype=torch.int64)  # -1: a padding token, nothing stored
    kv = torch.zeros(4, 2, 4, 2, 16, dtype=dtype)
    q_rot = K.rope_qk_kv_write(q, k, v, pos, cache, kv, slots)
    _ulp_close(q_rot, R.rope(q, pos, cache), dtype)  # padding tokens' q is rotated too
    ref = torch.zeros_like(kv)
    keep = slots >= 0
    R.write_kv_cache(R.rope(k, pos, cache)[keep], v[keep], ref, slots[keep])
    _ulp_close(kv, ref, dtype)
    assert torch.equal(kv[:, 1], ref[:, 1]), "V is stored as given"


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_with_fused_rope_matches_rope_then_attention(K, R, monkeypatch, dtype):
    """Decodes and a chunk continuing a cached prefix, prefill tiles straddling sequences: the fused call on
    un-roped q/k against the CPU library's rope, then its paged attention."""
    monkeypatch.setattr(K, "BLOCK_N", 16)
    monkeypatch.setattr(K, "BLOCK_Q", 4)
    g = torch.Generator().manual_seed(11)
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    seqs = [(20, 1), (5, 1), (13, 9), (0, 6)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    batch = _batch(seqs, block_size, num_blocks, g)
    T = batch.num_tokens
    cache = R.rope_cache(head_dim, 64, 10000.0)
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    kv_ref = kv.clone().float()
    pos = batch.positions
    # rope in the activation dtype (as the kernel rotates), attention in fp32
    ref = R.paged_attention(R.rope(q, pos, cache).float(), R.rope(k, pos, cache).float(), v.float(), kv_ref, batch,
                            scale=head_dim ** -0.5)
    out = K.paged_attention(q, k, v, kv, batch, head_dim ** -0.5, rope_cache=cache, partition_size=16)
    if dtype == torch.float32:
        torch.testing.assert_close(kv, kv_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(kv.float(), kv_ref, atol=4e-2, rtol=2 ** -6)
        # roped q/k differ from torch's by up to a bf16 ulp (interpreter truncation), P is rounded to bf16
        torch.testing.assert_close(out.float(), ref, atol=4e-2, rtol=0)
    # the CPU library's own fused entry point is the same composition
    kv_cpu = kv.clone().float().zero_()
    kv_ref2 = kv_cpu.clone()
    cpu = R.paged_attention(q.float(), k.float(), v.float(), kv_cpu, batch, scale=0.25, rope_cache=cache)
    torch.testing.assert_close(cpu, R.paged_attention(R.rope(q.float(), pos, cache), R.rope(k.float(), pos, cache),
                                                      v.float(), kv_ref2, batch, scale=0.25), atol=0, rtol=0)


def _compile(tiny_checkpoint, tmp_path, arch: str, target: str):
    import kiln
    from kiln.cli import main

    recipe = tmp_path / f"{arch}.dsl"
    if not recipe.exists():
        assert main(["recipe", "from-hf", str(tiny_checkpoint(arch)), "-o", str(recipe)]) == 0
    return kiln.compile(recipe, tmp_path / f"{arch}-{target}", target=target, progress=False)


def _fused_matches(manifest) -> int:
    (rec,) = [r for r in manifest["passes"] if r["name"] == "fuse_rope_kv_write"]
    return rec["stats"]["matches"]


def test_qwen3_h200_artifact_fuses_and_matches_cpu_artifact(tiny_checkpoint, tmp_path):
    """Qwen3 (per-head q/k norm before rope): the h200 artifact calls paged_attention with the rope table and
    never `K.rope`; its greedy tokens and prompt logprobs (Triton kernels under the interpreter) match the cpu
    artifact's, chunked prefill included."""
    import kiln

    cpu = _compile(tiny_checkpoint, tmp_path, "qwen3", "cpu")
    gpu = _compile(tiny_checkpoint, tmp_path, "qwen3", "h200")
    layers = cpu.manifest["kv_cache"]["num_layers"]
    for res, target in ((cpu, "cpu"), (gpu, "h200")):
        assert _fused_matches(res.manifest) == 1  # one decoder graph shared by every layer
        src = (tmp_path / f"qwen3-{target}" / "model.py").read_text()
        assert "K.rope(" not in src and src.count("rope_cache=self.rope_cache") == 1, src
    assert layers >= 2
    prompts = [list(range(5, 17)), [20, 30, 40]]
    params = kiln.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    ref = kiln.LLM(str(tmp_path / "qwen3-cpu")).generate(prompts, params)
    got = kiln.LLM(str(tmp_path / "qwen3-h200"), chunked_prefill=5).generate(prompts, params)
    for r, o in zip(ref, got, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        lp = lambda out: torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])  # noqa: E731
        torch.testing.assert_close(lp(o), lp(r), atol=1e-4, rtol=0)


def test_cpu_artifact_with_fused_rope_matches_hf(compile_hf, check_hf_parity):
    """The full cpu pipeline fuses every rope into its attention; greedy tokens and prompt logprobs still match
    Hugging Face with Llama-3.1 scaled rope (tests/facade/test_parity_hf.py checks every family on the same
    cached artifacts, this pass included)."""
    ckpt, art, res = compile_hf("llama3_rope")
    assert _fused_matches(res.manifest) >= 1
    assert "K.rope(" not in (art / "model.py").read_text()
    check_hf_parity(art, ckpt, vocab=512, new_tokens=8, lens=(5, 17))
