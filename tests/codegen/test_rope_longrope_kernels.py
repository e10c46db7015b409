"""LongRoPE and partial rotary (Phi-3.5, Phi-4-mini) against transformers' own (`ROPE_INIT_FUNCTIONS["longrope"]`,
Phi3RotaryEmbedding with its `dynamic_rope_update`, Phi-3's apply_rotary_pos_emb): the op table's frequencies and
attention factor, the IR reference, and the CPU and Triton libraries' `rope_cache` / `rope` (under
TRITON_INTERPRET=1) for a table serving the original context (short factors) and one serving beyond it (long
factors). fp32 tables are bit-identical. The fused Triton kernels with a partial table: test_triton_kernels.py
and test_rope_kv_write_fusion.py; the TVM library's: test_tvm_kernels.py."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from codegen_helpers import program_text, render_kernels, typed  # noqa: E402
from kiln.codegen import render_model  # noqa: E402
from kiln.compiler import parse_program  # noqa: E402
from kiln.compiler.ops import OPS, RefContext, longrope_factors, rope_attention_factor, rope_inv_freq  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Phi-4-mini's shape in miniature: 3/4 of a 16-dim head rotates; original context 32 of 128
HEAD_DIM, ROTARY, ORIGINAL, MAX_POS, THETA = 16, 12, 32, 128, 10000.0
SHORT = (1.0, 1.1, 1.3, 1.6, 2.0, 2.5)
LONG = (1.2, 1.9, 3.1, 5.0, 8.0, 12.5)
ATTRS = {"theta": THETA, "scaling": "longrope", "factor": MAX_POS / ORIGINAL, "original_max_position": ORIGINAL,
         "rotary_dim": ROTARY, "short_factor": SHORT, "long_factor": LONG}
SERVED = {"short": ORIGINAL, "long": MAX_POS}  # a table's length: at most the original context, or beyond it


@pytest.fixture(scope="module")
def hf():
    """(Phi3Config, Phi3RotaryEmbedding) of the miniature."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = transformers.Phi3Config(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                  original_max_position_embeddings=ORIGINAL, partial_rotary_factor=ROTARY / HEAD_DIM,
                                  rope_scaling={"rope_type": "longrope", "rope_theta": THETA,
                                                "short_factor": list(SHORT), "long_factor": list(LONG)})
    return cfg, Phi3RotaryEmbedding(cfg)


def _hf_rotated(rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF Phi-3's rotary embedding of x [T, H, D] at positions [T] (one sequence: it picks the factor set from
    max(positions) + 1), back in kiln's [T, H, D] layout."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    xb = x.transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rotary(xb, positions[None].long())
    out, _ = apply_rotary_pos_emb(xb, xb, cos, sin)
    return out[0].transpose(0, 1)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{"cpu": the CPU kernel library, "triton": the Triton one}, rendered as in an artifact."""
    triton = render_kernels(tmp_path_factory.mktemp("rope_longrope_kernels"), num_heads=4)
    return {"cpu": triton._ref, "triton": triton}


@pytest.mark.parametrize("branch", list(SERVED))
def test_op_table_frequencies_and_attention_factor_match_transformers(hf, branch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    seq_len = SERVED[branch] + (branch == "long")
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["longrope"](hf[0], "cpu", seq_len=seq_len)
    chosen = longrope_factors(SHORT, LONG, ORIGINAL, seq_len)
    assert chosen == (LONG if branch == "long" else SHORT)
    inv = rope_inv_freq(ROTARY, THETA, "longrope", 4.0, 1.0, 4.0, ORIGINAL, longrope_factors=chosen)
    assert torch.equal(inv, inv_hf)
    assert rope_attention_factor("longrope", 4.0, original_max_position=ORIGINAL) == factor_hf > 1
    assert rope_attention_factor("longrope", 4.0, attention_factor=1.5, original_max_position=ORIGINAL) == 1.5


@pytest.mark.parametrize("lib", ["cpu", "triton"])
@pytest.mark.parametrize("branch", list(SERVED))
def test_rope_cache_and_rope_match_transformers(hf, libs, lib, branch):
    """A table of `served` positions takes the factors transformers takes for a sequence that long; rotating
    12 of 16 dims, the other 4 passed through bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    K, served = libs[lib], SERVED[branch]
    cache = K.rope_cache(HEAD_DIM, served, THETA, **{k: v for k, v in ATTRS.items() if k != "theta"})
    assert cache.shape == (served, ROTARY)
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["longrope"](hf[0], "cpu", seq_len=served)
    freqs = torch.arange(served, dtype=torch.float32)[:, None] * inv_hf[None, :]
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1) * factor_hf, rtol=0, atol=0)

    positions = torch.tensor([0, 5, 17, 26, served - 1], dtype=torch.int32)  # HF's seq_len: `served`, same branch
    x = torch.randn(len(positions), 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    out = K.rope(x, positions, cache)
    torch.testing.assert_close(out, _hf_rotated(hf[1], x, positions), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., ROTARY:], x[..., ROTARY:])


@pytest.mark.parametrize("length", [20, 45], ids=["short", "long"])
def test_ir_reference_matches_transformers(hf, length):
    """The reference's one sequence: short factors up to the original context, long past it (as transformers)."""
    positions = torch.arange(length)
    x = torch.randn(length, 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    out = OPS["rope"].reference(RefContext(positions=positions), x, **{**OPS["rope"].attrs, **ATTRS})
    torch.testing.assert_close(out, _hf_rotated(hf[1], x, positions), rtol=1e-6, atol=1e-6)


def test_longrope_attributes_reach_the_rope_cache_call_with_the_chosen_set():
    rope = ('scaling="longrope", factor=4.0, original_max_position=16, rotary_dim=6, short_factor=[1.0, 1.5, 2.0], '
            'long_factor=[2.0, 4.0, 8.0]')
    text = program_text().replace('%q_rot = rope(%q) {kernel="cpu.rope", theta=10000.0}',
                                  '%q_rot = rope(%q) {kernel="cpu.rope", theta=10000.0, ' + rope + '}').replace(
        '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0}',
        '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0, ' + rope + '}')
    call = ('K.rope_cache(8, MAX_MODEL_LEN, theta=10000.0, scaling="longrope", factor=4.0, original_max_position=16, '
            'rotary_dim=6, short_factor=(1.0, 1.5, 2.0), long_factor=(2.0, 4.0, 8.0))')
    for served, chosen in ((16, "<= original_max_position 16: short_factor"),
                           (64, "> original_max_position 16: long_factor")):
        source = render_model(typed(parse_program(text)), kiln_version="test", recipe_hash="0", max_model_len=served)
        assert call in source and source.count("K.rope_cache(") == 1
        assert f"# LongRoPE: MAX_MODEL_LEN {served} {chosen} for every sequence" in source


@pytest.mark.parametrize("attrs,message", [
    ({"rotary_dim": 7}, r"rope rotary_dim must be an even number of dims <= head_dim 8 \(0: all\), got 7"),
    ({"rotary_dim": 10}, r"rotary_dim must be an even number of dims <= head_dim 8"),
    ({"scaling": "longrope", "rotary_dim": 6, "short_factor": [1.0, 1.0, 1.0], "long_factor": [2.0, 2.0]},
     r"longrope long_factor needs one factor per rotated dim pair \(3\), got 2"),
    ({"scaling": "longrope", "short_factor": [1.0, 1.0, 0.0, 1.0], "long_factor": [2.0, 2.0, 2.0, 2.0]},
     r"longrope short_factor must be positive finite numbers"),
    ({"scaling": "yarn", "factor": 2.0, "long_factor": [2.0, 2.0, 2.0, 2.0]},
     r"rope long_factor is LongRoPE's; scaling is 'yarn'"),
])
def test_rope_attributes_that_cannot_be_computed_are_refused_at_compile_time(attrs, message):
    items = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in attrs.items())
    text = program_text().replace('%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0}',
                                  '%k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0, ' + items + '}')
    with pytest.raises(Exception, match=message):
        typed(parse_program(text))
