"""fp8 (e4m3) MLA latent cache, `quantize { kv_cache = fp8 }` on a DeepSeek model: the CPU kernel's latent
write / read against an independent e4m3 rounding bound, the kernel (absorbed and un-absorbed) against the op
reference on an fp8 cache, and a tiny DeepSeek-V3 artifact end to end — its prompt logprobs within a KL bound
of the fp32-cache artifact, absorbed == un-absorbed, greedy decode over the fp8 cache equal to its own
teacher-forced prefill, and the manifest / report / runtime pool at 1 byte per latent element."""
from __future__ import annotations

import json
import math

import pytest
import torch
from kiln.compiler.ops import OPS, RefContext
from mla_testlib import HEADS, LORA, NOPE, ROPE, V_DIM
from test_mla_ops import _paged_batch

import kiln
from kiln.eval import ArtifactScorer

E4M3_MAX = 448.0
QUANTIZE = (("  serve ", "  quantize  { kv_cache = fp8 }\n  serve "),)
UNABSORBED = (("  serve ", '  passes    { disable = ["mla_absorption"] }\n  serve '),)
# KL(fp32 cache || fp8 cache), mean nats/token over 40 prompt tokens of the tiny random V3: measured 0.011
# (one scale for the whole latent row; tests/quant's per-head fp8 KV on a tiny Llama is bounded at 0.012)
KL_BOUND = 0.025


def _half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |y| (3 mantissa bits; subnormals below 2^-6 are spaced 2^-9)."""
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0 ** -6)))
    return 2.0 ** (e - 4)


def test_latent_write_read_round_trip_within_half_an_e4m3_step(K):
    g = torch.Generator().manual_seed(0)
    c_kv, k_pe = torch.randn(10, LORA, generator=g) * 2, torch.randn(10, 1, ROPE, generator=g)
    c_kv[0, 0] = 1e4  # saturates at 448 x scale instead of becoming NaN
    scale = torch.tensor([5.0 / E4M3_MAX])
    cache = torch.zeros(3, 4, LORA + ROPE, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([11, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    K.write_latent_cache(c_kv, k_pe, cache, slots, scale)
    stored = cache.flatten(0, 1)[slots].float()  # what the cache holds: x / scale in e4m3
    y = (torch.cat((c_kv, k_pe[:, 0]), -1) / scale).clamp(-E4M3_MAX, E4M3_MAX)
    assert stored[0, 0] == E4M3_MAX
    assert bool(((stored - y).abs() <= _half_ulp(y) + 1e-6).all())
    assert float((stored - y).abs().max()) > 0  # it did round
    # reading back: blocks [2, 0] hold tokens 9, (empty), (empty), 0 | 1, 2, 3, 4; dequantized x scale
    got = K.read_latent_cache(cache, torch.tensor([2, 0]), 6, torch.float32, scale)
    torch.testing.assert_close(got, torch.cat((stored[[9]], torch.zeros(2, LORA + ROPE), stored[[0, 1, 2]])) * scale,
                               rtol=0, atol=0)


@pytest.mark.parametrize("absorb", ["none", "decode"])
def test_kernel_on_fp8_cache_matches_reference(K, absorb):
    seqs = [(9, 1), (20, 1), (0, 13), (5, 7)]  # two decodes, a fresh prefill, a chunked prefill
    per_seq, cache, batch = _paged_batch(seqs, block_size=4)
    scale = torch.tensor([cache.abs().max().item() / E4M3_MAX])
    fp8 = (cache / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # the cached prefixes, quantized
    w_kv_b = torch.randn(HEADS * (NOPE + V_DIM), LORA) * LORA ** -0.5
    sm = (NOPE + ROPE) ** -0.5
    new = lambda i: torch.cat([s[i][s[0]:] for s in per_seq])  # noqa: E731
    out = K.mla_attention(new(1), new(2), new(3), new(4), w_kv_b, fp8, batch, sm, absorb=absorb, kv_scale=scale)
    refs, plain = [], []
    for cached, qn, qp, c, pe in per_seq:
        ctx = RefContext(positions=torch.arange(c.shape[0]))
        ref = OPS["mla_attention"].reference
        refs.append(ref(ctx, qn, qp, c, pe, w_kv_b, scale, scale=sm, kv_dtype="fp8e4m3")[cached:])
        plain.append(ref(ctx, qn, qp, c, pe, w_kv_b, scale=sm)[cached:])
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=0)
    assert float((out - torch.cat(plain)).abs().max()) > 1e-4  # the cache really is rounded


@pytest.fixture(scope="module")
def arts(compile_hf):
    return {name: compile_hf("deepseek_v3", edits=edits) for name, edits in
            (("fp32", ()), ("fp8", QUANTIZE), ("fp8-unabsorbed", QUANTIZE + UNABSORBED))}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(5, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def _log_probs(art, tokens):
    return ArtifactScorer(art, len(tokens)).log_probs(tokens)


def test_artifact_logprobs_close_to_fp32_cache(arts, tokens):
    base = _log_probs(arts["fp32"][1], tokens)
    fp8 = _log_probs(arts["fp8"][1], tokens)
    kl = float((base.exp() * (base - fp8)).sum(-1).mean())
    assert 0 < kl < KL_BOUND
    torch.testing.assert_close(_log_probs(arts["fp8-unabsorbed"][1], tokens), fp8, atol=1e-4, rtol=0)


def test_greedy_decode_over_fp8_latents(arts, tokens):
    """Each generated token's logprob, decoded one step at a time over the fp8 cache (absorbed and not), equals
    the artifact's own one-prefill logprob on the full sequence, and stays near the fp32-cache artifact's."""
    params = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = tokens[:16]
    outs = {}
    for name in ("fp8", "fp8-unabsorbed"):
        out = kiln.LLM(str(arts[name][1])).generate([prompt], params)[0].outputs[0]
        outs[name] = out
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)])
        full = prompt + out.token_ids
        ids = torch.tensor(out.token_ids)[:, None]
        own = _log_probs(arts[name][1], full)[len(prompt) - 1:-1].gather(1, ids)[:, 0]
        ref = _log_probs(arts["fp32"][1], full)[len(prompt) - 1:-1].gather(1, ids)[:, 0]
        torch.testing.assert_close(ours, own, rtol=0, atol=1e-4)
        assert float((ours - ref).abs().mean()) < 0.05
    assert outs["fp8"].token_ids == outs["fp8-unabsorbed"].token_ids


def test_manifest_report_and_pool_at_one_byte_per_latent_element(arts):
    _, base, base_res = arts["fp32"]
    _, art, res = arts["fp8"]
    layers, latent = 3, LORA + ROPE
    kv, base_kv = (json.loads((a / "manifest.json").read_text())["kv_cache"] for a in (art, base))
    assert kv["dtype"] == "float8_e4m3fn" and base_kv["dtype"] == "float32"
    assert kv["bytes_per_token"] == layers * latent * 1 and base_kv["bytes_per_token"] == layers * latent * 4
    assert f"KV bytes per token     {layers * latent} B  (= {layers} MLA layers x latent {latent}" in res.report
    assert "x 1 B)" in res.report
    scales = [n for n in res.program.params if n.endswith("kv_scale")]
    assert scales and all(res.program.params[n].shape == (1,) for n in scales)
    assert 'kv_scale=' in (art / "model.py").read_text()
    llm, llm_base = kiln.LLM(str(art)), kiln.LLM(str(base))
    caches = llm.engine.runner.kv_caches
    assert len(caches) == layers and all(c.dtype == torch.float8_e4m3fn and c.shape[2] == latent for c in caches)
    assert math.isclose(llm.engine.block_manager.num_blocks / llm_base.engine.block_manager.num_blocks, 4, rel_tol=0.01)
