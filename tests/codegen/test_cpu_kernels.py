"""The CPU kernel library (codegen/templates/cpu/kernels.py.j2) against independent torch references."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import jinja2
import pytest
import torch
import torch.nn.functional as F
from kiln.runtime.forward_batch import ForwardBatch

TEMPLATES = Path(__file__).resolve().parents[2] / "codegen" / "templates"


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    source = env.get_template("cpu/kernels.py.j2").render(kiln_version="0.0.test")
    path = tmp_path_factory.mktemp("artifact") / "cpu_kernels.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kiln_test_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_render_is_deterministic_and_versioned(K):
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    a = env.get_template("cpu/kernels.py.j2").render(kiln_version="1.2.3")
    assert a == env.get_template("cpu/kernels.py.j2").render(kiln_version="1.2.3")
    assert "kiln 1.2.3" in a.split('"""')[1]
    assert "0.0.test" in K.__doc__
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("cpu/kernels.py.j2").render()


# ---------------------------------------------------------------- elementwise, norms, linear


def test_embedding(K):
    table = torch.randn(50, 8)
    ids = torch.tensor([3, 0, 49, 3], dtype=torch.int32)
    torch.testing.assert_close(K.embedding(ids, table), table[ids.long()], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hf(K, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32))
    x = torch.randn(3, 5, 32).to(dtype)
    out = K.rms_norm(x, hf.weight.detach(), 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, hf(x).detach(), rtol=0, atol=0)


def test_add_rms_norm(K):
    x, residual, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    normed, summed = K.add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(summed, x + residual)
    ref = w * (summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed, ref)


def test_linear_and_swiglu(K):
    x, w, b = torch.randn(2, 3, 8), torch.randn(6, 8), torch.randn(6)
    torch.testing.assert_close(K.linear(x, w, b), x @ w.T + b)
    torch.testing.assert_close(K.linear(x, w), x @ w.T)
    torch.testing.assert_close(K.silu(x), x * torch.sigmoid(x))
    gate_up = torch.randn(5, 12)
    ref = gate_up[:, :6] * torch.sigmoid(gate_up[:, :6]) * gate_up[:, 6:]
    out = K.silu_mul(gate_up)
    assert out.shape == (5, 6)
    torch.testing.assert_close(out, ref)


def test_logits_selects_rows_and_returns_fp32(K):
    x, w = torch.randn(7, 16, dtype=torch.bfloat16), torch.randn(40, 16, dtype=torch.bfloat16)
    idx = torch.tensor([6, 2], dtype=torch.int32)
    out = K.logits(x, w, idx)
    assert out.dtype == torch.float32 and out.shape == (2, 40)
    torch.testing.assert_close(out, x[idx.long()].float() @ w.float().T, rtol=2e-2, atol=5e-2)
    x32, w32 = x.float(), w.float()
    torch.testing.assert_close(K.logits(x32, w32, idx), x32[[6, 2]] @ w32.T)


# ---------------------------------------------------------------- rotary embedding


def _rope_reference(x, positions, head_dim, theta, pos_scale=1.0):
    # the formula, written out per pair (i, i + D/2)
    half = head_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    angle = positions.double()[:, None] / pos_scale * theta ** (-2 * i / head_dim)  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("linear", 4.0)])
def test_rope_matches_formula(K, scaling, factor):
    T, H, D = 6, 3, 16
    cache = K.rope_cache(D, 128, 10000.0, scaling=scaling, factor=factor)
    assert cache.shape == (128, D) and cache.dtype == torch.float32
    x = torch.randn(T, H, D)
    positions = torch.tensor([0, 1, 5, 17, 100, 127], dtype=torch.int32)
    out = K.rope(x, positions, cache)
    torch.testing.assert_close(
        out.double(), _rope_reference(x, positions, D, 10000.0, factor), atol=2e-5, rtol=1e-5
    )


def test_rope_matches_hf_apply_rotary_pos_emb(K):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_theta=500000.0)
    rotary = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([[0, 3, 9, 63]])
    q = torch.randn(1, 4, 4, 16)  # [B, H, S, D]
    cos, sin = rotary(q, positions)
    ref, _ = apply_rotary_pos_emb(q, q, cos, sin)
    out = K.rope(q[0].transpose(0, 1), positions[0], K.rope_cache(16, 64, 500000.0))
    torch.testing.assert_close(out, ref[0].transpose(0, 1), rtol=0, atol=0)


def test_rope_llama3_matches_transformers(K):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={**params, "rope_theta": 10000.0},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert attention_factor == 1.0
    positions = torch.arange(256, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cache = K.rope_cache(
        32,
        256,
        10000.0,
        scaling="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=64,
    )
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1), rtol=0, atol=0)
    # scaling really changed something at this size
    assert not torch.equal(cache, K.rope_cache(32, 256, 10000.0))


def test_rope_cache_rejects_unknown_scaling(K):
    with pytest.raises(ValueError, match="unknown rope scaling 'dynamic'"):
        K.rope_cache(16, 8, 10000.0, scaling="dynamic")
    with pytest.raises(ValueError, match=r"longrope needs one factor per rotated dim pair \(8\), got 0"):
        K.rope_cache(16, 8, 10000.0, scaling="longrope")


def test_rope_bf16_keeps_dtype(K):
    x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    out = K.rope(x, torch.arange(4), K.rope_cache(8, 16, 10000.0))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), _rope_reference(x.float(), torch.arange(4), 8, 10000.0), atol=3e-2, rtol=2e-2
    )


# ---------------------------------------------------------------- paged attention


def _dense_reference(q, k, v, scale, sliding_window):
    """Causal attention of q [S_q, H, D] (the last S_q positions) over k, v [S, KVH, D], via SDPA."""
    S_q, H, _ = q.shape
    S, KVH, _ = k.shape
    kk = k.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    qp = torch.arange(S - S_q, S)[:, None]
    kp = torch.arange(S)[None, :]
    mask = kp <= qp
    if sliding_window:
        mask &= kp > qp - sliding_window
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(S_q, -1)


def _run_paged(K, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, sliding_window=0, seed=0):
    """seqs: list of (cached_len, new_len), decodes first. Returns (kernel out, reference out, kv_cache)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order physical blocks

    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    qs, ks, vs, slots, refs, positions, starts = [], [], [], [], [], [], [0]
    for b, (cached, new) in enumerate(seqs):
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k_all = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_all = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        q_new = torch.randn(new, num_heads, head_dim, generator=gen).to(dtype)
        for p in range(cached):  # the prefix already sits in the cache
            kv_cache[blocks[p // block_size], 0, p % block_size] = k_all[p]
            kv_cache[blocks[p // block_size], 1, p % block_size] = v_all[p]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        positions += list(range(cached, total))
        qs.append(q_new)
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        refs.append(_dense_reference(q_new, k_all, v_all, head_dim**-0.5, sliding_window))
        starts.append(starts[-1] + new)

    T = starts[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int32),
        num_decodes=sum(1 for _, n in seqs if n == 1),
    )
    out = K.paged_attention(
        torch.cat(qs),
        torch.cat(ks),
        torch.cat(vs),
        kv_cache,
        batch,
        head_dim**-0.5,
        sliding_window=sliding_window,
    )
    return out, torch.cat(refs), kv_cache, batch, torch.cat(ks), torch.cat(vs)


# two decodes, a fresh prefill, and a prefill chunk continuing a cached prefix
MIXED = [(9, 1), (20, 1), (0, 7), (13, 6)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_paged_attention_mixed_batch(K, block_size, num_heads, num_kv_heads):
    out, ref, *_ = _run_paged(K, MIXED, num_heads, num_kv_heads, 16, block_size, torch.float32)
    assert out.shape == (sum(n for _, n in MIXED), num_heads * 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_paged_attention_writes_new_kv_to_slots(K):
    _, _, kv_cache, batch, k, v = _run_paged(K, MIXED, 8, 2, 16, 4, torch.float32)
    slots = batch.slot_mapping
    torch.testing.assert_close(kv_cache[slots // 4, 0, slots % 4], k, rtol=0, atol=0)
    torch.testing.assert_close(kv_cache[slots // 4, 1, slots % 4], v, rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 5, 8])
def test_paged_attention_sliding_window(K, window):
    out, ref, *_ = _run_paged(K, MIXED, 8, 2, 16, 4, torch.float32, sliding_window=window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    full, *_ = _run_paged(K, MIXED, 8, 2, 16, 4, torch.float32)
    assert not torch.allclose(out, full)  # the window really cut context


def test_paged_attention_matches_hf_mistral_window_mask(K):
    from transformers.masking_utils import sliding_window_overlay

    # HF's own predicate: query q sees key k iff k > q - W (and k <= q)
    inner = sliding_window_overlay(3)
    assert inner(0, 0, 10, 8) and not inner(0, 0, 10, 7)


def test_paged_attention_bf16(K):
    out, ref, *_ = _run_paged(K, MIXED, 8, 2, 16, 16, torch.bfloat16, seed=1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------- the kernels composed into a whole model


def _kernel_forward(K, model, input_ids, block_size=4):
    """A hand-written Llama/Qwen/Mistral forward from the kernels alone, over paged KV, in two steps:
    a prefill of all but the last token, then a decode of the last one. Returns fp32 logits [S, V]."""
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rope_params = dict(cfg.rope_parameters)
    if rope_params["rope_type"] == "llama3":
        cache = K.rope_cache(
            D,
            cfg.max_position_embeddings,
            rope_params["rope_theta"],
            scaling="llama3",
            factor=rope_params["factor"],
            low_freq_factor=rope_params["low_freq_factor"],
            high_freq_factor=rope_params["high_freq_factor"],
            original_max_position=rope_params["original_max_position_embeddings"],
        )
    else:
        cache = K.rope_cache(D, cfg.max_position_embeddings, rope_params["rope_theta"])
    window = getattr(cfg, "sliding_window", None) or 0
    if getattr(cfg, "use_sliding_window", True) is False:
        window = 0
    S = input_ids.shape[0]
    num_blocks = (S + block_size - 1) // block_size
    kv = [torch.zeros(num_blocks + 2, 2, block_size, KVH, D) for _ in range(cfg.num_hidden_layers)]
    table = torch.tensor(list(range(num_blocks + 1, 0, -1))[:num_blocks], dtype=torch.int32)[None]

    def step(ids, pos):
        pos_l = pos.long()
        batch = ForwardBatch(
            input_ids=ids.int(),
            positions=pos.int(),
            query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([int(pos[-1]) + 1], dtype=torch.int32),
            block_tables=table,
            slot_mapping=table[0, pos_l // block_size].long() * block_size + pos_l % block_size,
            logits_indices=torch.arange(len(ids), dtype=torch.int32),
            num_decodes=int(len(ids) == 1),
        )
        eps = cfg.rms_norm_eps
        x = K.embedding(batch.input_ids, sd["model.embed_tokens.weight"])
        residual = x
        h = K.rms_norm(x, sd["model.layers.0.input_layernorm.weight"], eps)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q = K.linear(h, sd[a + "q_proj.weight"], sd.get(a + "q_proj.bias")).view(-1, H, D)
            k = K.linear(h, sd[a + "k_proj.weight"], sd.get(a + "k_proj.bias")).view(-1, KVH, D)
            v = K.linear(h, sd[a + "v_proj.weight"], sd.get(a + "v_proj.bias")).view(-1, KVH, D)
            if a + "q_norm.weight" in sd:  # Qwen3: per-head RMSNorm on q and k, before rope
                q = K.rms_norm(q, sd[a + "q_norm.weight"], eps)
                k = K.rms_norm(k, sd[a + "k_norm.weight"], eps)
            q, k = K.rope(q, batch.positions, cache), K.rope(k, batch.positions, cache)
            o = K.paged_attention(q, k, v, kv[i], batch, D**-0.5, sliding_window=window)
            o = K.linear(o, sd[a + "o_proj.weight"])
            h, residual = K.add_rms_norm(o, residual, sd[p + "post_attention_layernorm.weight"], eps)
            m = p + "mlp."
            gate_up = torch.cat((sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]))
            o = K.linear(K.silu_mul(K.linear(h, gate_up)), sd[m + "down_proj.weight"])
            next_norm = (
                f"model.layers.{i + 1}.input_layernorm.weight"
                if i + 1 < cfg.num_hidden_layers
                else "model.norm.weight"
            )
            h, residual = K.add_rms_norm(o, residual, sd[next_norm], eps)
        lm_head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        return K.logits(h, lm_head, batch.logits_indices)

    prefill = step(input_ids[:-1], torch.arange(S - 1))
    decode = step(input_ids[-1:], torch.tensor([S - 1]))
    return torch.cat((prefill, decode))


@pytest.mark.parametrize(
    "arch", ["llama", "llama3_rope", "llama_tied", "llama_head_dim", "mistral", "qwen2", "qwen3"]
)
def test_kernels_compose_to_hf_logits(K, tiny_checkpoint, tiny_checkpoint_lib, arch):
    model = tiny_checkpoint_lib.load_hf_model(tiny_checkpoint(arch))
    ids = torch.randint(5, 512, (90,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        out = _kernel_forward(K, model, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
