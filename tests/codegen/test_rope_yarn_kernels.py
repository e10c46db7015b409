"""YaRN rope against transformers' own yarn (`ROPE_INIT_FUNCTIONS["yarn"]`, LlamaRotaryEmbedding,
apply_rotary_pos_emb): the op table's frequencies and attention factor, the IR reference, the CPU library's
`rope_cache`/`rope`, and the Triton library's (under TRITON_INTERPRET=1). fp32 tables are bit-identical."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from codegen_helpers import program_text, render_kernels, typed  # noqa: E402
from kiln.codegen import render_model  # noqa: E402
from kiln.compiler import parse_program  # noqa: E402
from kiln.compiler.ops import OPS, RefContext, rope_attention_factor, rope_inv_freq  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MAX_POS = 96

# (head_dim, theta, transformers rope_parameters, the same as kiln rope attributes)
CASES = {
    # every published DeepSeek-V3 / R1 checkpoint (rope dim 64): mscale == mscale_all_dim, attention factor 1
    "deepseek_v3": (64, 10000.0,
                    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
                    {"factor": 40.0, "original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Qwen2.5 / Qwen3 long context: only factor and the original context; attention factor 0.1 ln 4 + 1
    "qwen": (128, 1000000.0, {"factor": 4.0, "original_max_position_embeddings": 32768},
             {"factor": 4.0, "original_max_position": 32768}),
    # a short original context (the ramp covers most dims), mscale ratio != 1, no truncation of the ramp ends
    "short_untruncated": (16, 10000.0,
                          {"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                           "mscale_all_dim": 1.0, "truncate": False},
                          {"factor": 4.0, "original_max_position": 16, "mscale": 0.707, "mscale_all_dim": 1.0,
                           "truncate": False}),
    # an explicit attention factor wins; custom betas
    "explicit_factor": (32, 500.0,
                        {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3,
                         "beta_fast": 8, "beta_slow": 2},
                        {"factor": 2.0, "original_max_position": 64, "attention_factor": 1.3, "beta_fast": 8.0,
                         "beta_slow": 2.0}),
}


def _hf(case: str):
    """(inv_freq, attention_factor, LlamaRotaryEmbedding) from transformers for a CASES entry."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, params, _ = CASES[case]
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv_freq, attention_factor, LlamaRotaryEmbedding(cfg)


def _hf_rotated(rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding of x [T, H, D] at positions [T], back in kiln's [T, H, D] layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    xb = x.transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rotary(xb, positions[None].long())
    out, _ = apply_rotary_pos_emb(xb, xb, cos, sin)
    return out[0].transpose(0, 1)




@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{"cpu": the CPU kernel library, "triton": the Triton one}, rendered as in an artifact."""
    triton = render_kernels(tmp_path_factory.mktemp("rope_yarn_kernels"), num_heads=4)
    return {"cpu": triton._ref, "triton": triton}


@pytest.mark.parametrize("case", list(CASES))
def test_op_table_frequencies_and_attention_factor_match_transformers(case):
    inv_hf, factor_hf, _ = _hf(case)
    head_dim, theta, _, a = CASES[case]
    inv = rope_inv_freq(head_dim, theta, "yarn", a["factor"], 1.0, 4.0, a["original_max_position"],
                        a.get("beta_fast", 32.0), a.get("beta_slow", 1.0), a.get("truncate", True))
    assert torch.equal(inv, inv_hf)
    assert rope_attention_factor("yarn", a["factor"], a.get("mscale", 0.0), a.get("mscale_all_dim", 0.0),
                                 a.get("attention_factor", 0.0)) == factor_hf
    # yarn really changed the frequencies, and (but for DeepSeek's equal mscales) the magnitude
    assert not torch.equal(inv, rope_inv_freq(head_dim, theta, "none", 1.0, 1.0, 4.0, 8192))
    assert (factor_hf == 1.0) == (case == "deepseek_v3")


@pytest.mark.parametrize("lib", ["cpu", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_cache_and_rope_match_transformers(libs, lib, case):
    K = libs[lib]
    inv_hf, factor_hf, rotary = _hf(case)
    head_dim, theta, _, a = CASES[case]
    cache = K.rope_cache(head_dim, MAX_POS, theta, scaling="yarn", **a)
    freqs = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_hf[None, :]
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1) * factor_hf, rtol=0, atol=0)

    positions = torch.tensor([0, 5, 17, 40, 63, MAX_POS - 1], dtype=torch.int32)
    x = torch.randn(len(positions), 3, head_dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(K.rope(x, positions, cache), _hf_rotated(rotary, x, positions), rtol=1e-6, atol=1e-6)


def test_fused_rope_qk_kv_write_with_a_yarn_table_matches_transformers(libs):
    """The fuse_rope_kv_write kernel reads the same table: yarn's magnitude reaches q and the cached K."""
    K = libs["triton"]
    _, _, rotary = _hf("short_untruncated")
    head_dim, theta, _, a = CASES["short_untruncated"]
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([2, 20, 45, MAX_POS - 1], dtype=torch.int32)
    q, k, v = (torch.randn(len(positions), h, head_dim, generator=g) for h in (4, 2, 2))
    kv = torch.zeros(2, 2, 4, 2, head_dim)  # [blocks, K|V, block_size, kv_heads, head_dim]
    slots = torch.tensor([5, 0, 7, 2])
    q_rot = K.rope_qk_kv_write(q, k, v, positions, K.rope_cache(head_dim, MAX_POS, theta, scaling="yarn", **a),
                               kv, slots)
    torch.testing.assert_close(q_rot, _hf_rotated(rotary, q, positions), rtol=1e-6, atol=1e-6)
    cached_k = kv[:, 0].reshape(-1, 2, head_dim)[slots]
    torch.testing.assert_close(cached_k, _hf_rotated(rotary, k, positions), rtol=1e-6, atol=1e-6)
    assert torch.equal(kv[:, 1].reshape(-1, 2, head_dim)[slots], v)


@pytest.mark.parametrize("case", ["short_untruncated", "explicit_factor"])
def test_ir_reference_matches_transformers(case):
    _, _, rotary = _hf(case)
    head_dim, theta, _, a = CASES[case]
    positions = torch.tensor([0, 3, 16, 50, MAX_POS - 1])
    x = torch.randn(len(positions), 2, head_dim, generator=torch.Generator().manual_seed(1))
    attrs = {**OPS["rope"].attrs, "theta": theta, "scaling": "yarn", **a}
    out = OPS["rope"].reference(RefContext(positions=positions), x, **attrs)
    torch.testing.assert_close(out, _hf_rotated(rotary, x, positions), rtol=1e-6, atol=1e-6)


def test_yarn_attributes_reach_the_rope_cache_call():
    text = program_text().replace(
        '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0}',
        '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0, scaling="yarn", factor=4.0, '
        'original_max_position=16, beta_fast=8.0, mscale=0.707, mscale_all_dim=1.0, truncate=false}')
    source = render_model(typed(parse_program(text)), kiln_version="test", recipe_hash="0", max_model_len=64)
    assert ('K.rope_cache(8, MAX_MODEL_LEN, theta=10000.0, scaling="yarn", factor=4.0, original_max_position=16, '
            'beta_fast=8.0, mscale=0.707, mscale_all_dim=1.0, truncate=False)') in source


def test_unknown_scaling_is_refused_at_compile_time():
    text = program_text().replace('%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0}',
                                  '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0, scaling="yran"}')
    with pytest.raises(Exception, match=r"unknown rope scaling 'yran' \(known: none, linear, llama3, yarn, longrope\)"):
        typed(parse_program(text))
