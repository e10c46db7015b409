"""MLA ops (op-table references) against HF DeepseekV3Attention / DeepseekV2Attention, and the CPU
`mla_attention` kernel over a paged latent cache (absorbed decodes, un-absorbed prefills) against the reference."""
from __future__ import annotations

import math
import random

import pytest
import torch
from kiln.compiler.ir import Attrs, TensorType
from kiln.compiler.ops import OPS, RefContext, ShapeError, infer
from kiln.runtime.forward_batch import ForwardBatch
from mla_testlib import HEADS, LORA, NOPE, ROPE, V_DIM

transformers = pytest.importorskip("transformers")
HIDDEN, T = 64, 11


def _ref(op, ctx, *args, **attrs):
    return OPS[op].reference(ctx, *args, **attrs)


def _hf_attention(v2: bool, q_lora_rank, seed=0):
    if v2:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod
        cfg = transformers.DeepseekV2Config
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod
        cfg = transformers.DeepseekV3Config
    config = cfg(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
                 kv_lora_rank=LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM,
                 attn_implementation="eager", rope_theta=10000.0)
    torch.manual_seed(seed)
    prefix = "DeepseekV2" if v2 else "DeepseekV3"
    attn = getattr(mod, f"{prefix}Attention")(config, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)
    rotary = getattr(mod, f"{prefix}RotaryEmbedding")(config)
    return attn, rotary


def _ours(attn, x, v2: bool):
    """The deepseek_v3.dsl attention, op by op through the op table's references."""
    sd = {k: v for k, v in attn.state_dict().items()}
    ctx = RefContext(positions=torch.arange(x.shape[0]))
    if "q_proj.weight" in sd:
        q = _ref("linear", ctx, x, sd["q_proj.weight"])
    else:
        qa = _ref("rms_norm", ctx, _ref("linear", ctx, x, sd["q_a_proj.weight"]), sd["q_a_layernorm.weight"], eps=1e-6)
        q = _ref("linear", ctx, qa, sd["q_b_proj.weight"])
    q = _ref("view", ctx, q, shape=[HEADS, NOPE + ROPE])
    q_nope = _ref("slice", ctx, q, start=0, stop=NOPE)
    q_pe = _ref("deinterleave", ctx, _ref("slice", ctx, q, start=NOPE, stop=NOPE + ROPE))
    kv = _ref("linear", ctx, x, sd["kv_a_proj_with_mqa.weight"])
    c_kv = _ref("rms_norm", ctx, _ref("slice", ctx, kv, start=0, stop=LORA), sd["kv_a_layernorm.weight"], eps=1e-6)
    k_pe = _ref("deinterleave", ctx, _ref("view", ctx, _ref("slice", ctx, kv, start=LORA, stop=LORA + ROPE), shape=[1, ROPE]))
    rope = {k: v for k, v in OPS["rope"].attrs.items()}
    q_pe, k_pe = _ref("rope", ctx, q_pe, **rope), _ref("rope", ctx, k_pe, **rope)
    outs = [_ref("mla_attention", ctx, q_nope, q_pe, c_kv, k_pe, sd["kv_b_proj.weight"], absorb=a)
            for a in ("none", "decode")]
    return [_ref("linear", ctx, a, sd["o_proj.weight"]) for a in outs]


@pytest.mark.parametrize("v2,q_lora_rank", [(False, 24), (False, None), (True, None)], ids=["v3", "v3-no-q-lora", "v2"])
@torch.no_grad()
def test_mla_ops_match_hf_attention(v2, q_lora_rank):
    attn, rotary = _hf_attention(v2, q_lora_rank)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ref, _ = attn(x[None], position_embeddings=rotary(x[None], pos), attention_mask=mask)
    unabsorbed, absorbed = _ours(attn, x, v2)
    torch.testing.assert_close(unabsorbed, ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(absorbed, ref[0], atol=1e-5, rtol=0)


def test_deinterleave_then_rope_is_hf_interleaved_rope():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    x = torch.randn(1, 3, T, ROPE)
    pos = torch.arange(T)
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    freqs = pos[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    ref, _ = apply_rotary_pos_emb_interleave(x, x, emb.cos()[None], emb.sin()[None])
    ctx = RefContext(positions=pos)
    ours = _ref("rope", ctx, _ref("deinterleave", ctx, x[0].transpose(0, 1)), **OPS["rope"].attrs)
    torch.testing.assert_close(ours.transpose(0, 1)[None], ref, atol=1e-6, rtol=0)


def test_shape_rules():
    t = lambda *s: TensorType(s, "f32")  # noqa: E731
    ins = [t("T", 4, 16), t("T", 4, 8), t("T", 32), t("T", 1, 8), t(4 * 32, 32)]
    assert infer("mla_attention", ins, Attrs({})) == t("T", 4 * 16)
    with pytest.raises(ShapeError, match="k_pe"):
        infer("mla_attention", [*ins[:3], t("T", 4, 8), ins[4]], Attrs({}))
    with pytest.raises(ShapeError, match="w_kv_b"):
        infer("mla_attention", [*ins[:4], t(4 * 32, 16)], Attrs({}))
    with pytest.raises(ShapeError, match="absorb"):
        infer("mla_attention", ins, Attrs({"absorb": "always"}))


def _paged_batch(seqs, block_size, seed=0):
    """seqs: (cached, new) per sequence, decodes first. Latent of every context token, a paged cache holding the
    cached prefix, and the batch of new tokens."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    cache = torch.zeros(num_blocks, block_size, LORA + ROPE)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    per_seq, slots, positions, starts = [], [], [], [0]
    for b, (cached, new) in enumerate(seqs):
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        c = torch.randn(total, LORA, generator=gen)
        pe = torch.randn(total, 1, ROPE, generator=gen)
        qn = torch.randn(total, HEADS, NOPE, generator=gen)
        qp = torch.randn(total, HEADS, ROPE, generator=gen)
        for p in range(cached):
            cache[blocks[p // block_size], p % block_size] = torch.cat([c[p], pe[p, 0]])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        positions += range(cached, total)
        per_seq.append((cached, qn, qp, c, pe))
        starts.append(starts[-1] + new)
    batch = ForwardBatch(input_ids=torch.zeros(starts[-1], dtype=torch.int32),
                         positions=torch.tensor(positions, dtype=torch.int32),
                         query_start_loc=torch.tensor(starts, dtype=torch.int32),
                         seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32), block_tables=tables,
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int32),
                         num_decodes=sum(1 for _, n in seqs if n == 1))
    return per_seq, cache, batch


@pytest.mark.parametrize("absorb", ["none", "decode"])
def test_kernel_matches_reference_on_a_mixed_paged_batch(K, absorb):
    seqs = [(9, 1), (20, 1), (0, 13), (5, 7)]  # two decodes, a fresh prefill, a chunked prefill
    per_seq, cache, batch = _paged_batch(seqs, block_size=4)
    w_kv_b = torch.randn(HEADS * (NOPE + V_DIM), LORA) * LORA ** -0.5
    scale = (NOPE + ROPE) ** -0.5
    new = lambda i, _: torch.cat([s[i][s[0]:] for s in per_seq])  # noqa: E731
    out = K.mla_attention(new(1, 0), new(2, 0), new(3, 0), new(4, 0), w_kv_b, cache, batch, scale, absorb=absorb)
    refs = []
    for cached, qn, qp, c, pe in per_seq:
        ctx = RefContext(positions=torch.arange(c.shape[0]))
        refs.append(OPS["mla_attention"].reference(ctx, qn, qp, c, pe, w_kv_b, scale=scale)[cached:])
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=0)
    # only the latent is cached: [c_kv | k_pe] at every new token's slot
    slots = batch.slot_mapping
    torch.testing.assert_close(cache.flatten(0, 1)[slots], torch.cat([new(3, 0), new(4, 0)[:, 0]], dim=-1))


def test_kernel_decode_absorbed_equals_unabsorbed(K):
    seqs = [(30, 1), (3, 1), (17, 1)]
    per_seq, cache, batch = _paged_batch(seqs, block_size=8, seed=2)
    w_kv_b = torch.randn(HEADS * (NOPE + V_DIM), LORA) * LORA ** -0.5
    args = [torch.cat([s[i][s[0]:] for s in per_seq]) for i in (1, 2, 3, 4)]
    a = K.mla_attention(*args, w_kv_b, cache.clone(), batch, 0.2, absorb="decode")
    b = K.mla_attention(*args, w_kv_b, cache.clone(), batch, 0.2, absorb="none")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
