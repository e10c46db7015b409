"""gpt-oss's kernels against the op table's torch references (compiler/ops.py) and transformers: paged attention
with per-head sinks in the cpu library and the Triton kernels (prefill, decode, split-KV decode, under Triton's
CPU interpreter), with and without a sliding window; routed experts with biases and the clamped SwiGLU."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from kiln.compiler.ops import OPS, RefContext  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from codegen_helpers import render_kernels  # noqa: E402
from test_gemma_kernels import BLOCK, _paged  # noqa: E402


@pytest.fixture(scope="module")
def K(tmp_path_factory):
    return render_kernels(tmp_path_factory.mktemp("gpt_oss_kernels"), head_dim=16, num_heads=4, num_kv_heads=2,
                          block_size=BLOCK)


def _hf_sink_attention(q, k, v, sinks, scale, window):
    """transformers' gpt_oss eager_attention_forward on one sequence (causal, optional sliding window)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    S = q.shape[0]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    mask = torch.where(visible, 0.0, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = q.shape[1] // k.shape[1], False, sinks
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=scale)
    return out[0].reshape(S, -1)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("new,partition", [(13, None), (1, None), (1, 16)], ids=["prefill", "decode", "split"])
def test_sink_paged_attention_matches_reference_and_hf(K, window, new, partition, monkeypatch):
    g = torch.Generator().manual_seed(window + new + (partition or 0))
    S, scale = (40 if partition else 13), 16 ** -0.5  # split: 3 partitions of 16 tokens
    q, k, v = (torch.randn(S, h, 16, generator=g) for h in (4, 2, 2))
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])  # a large sink takes most of its head's mass
    ctx = RefContext(positions=torch.arange(S))
    ref = OPS["attention"].reference(ctx, q, k, v, sinks, scale=scale, sliding_window=window)
    torch.testing.assert_close(ref, _hf_sink_attention(q, k, v, sinks, scale, window), atol=1e-6, rtol=1e-6)
    ref = ref[S - new:]
    plain = OPS["attention"].reference(ctx, q, k, v, scale=scale, sliding_window=window)[S - new:]
    assert not torch.allclose(ref, plain, atol=1e-2)
    perm = torch.randperm(-(-S // BLOCK) + 2, generator=g)
    qn, kn, vn, cache, batch = _paged(q, k, v, new, perm)
    out = K._ref.paged_attention(qn, kn, vn, cache, batch, scale, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    monkeypatch.setattr(K._ref, "paged_attention", None)  # the Triton kernels, never their torch fallback
    qn, kn, vn, cache, batch = _paged(q, k, v, new, perm)
    config = dict(block_n=16, partition=partition, num_warps=4, num_stages=None) if partition else None
    out = K.paged_attention(qn, kn, vn, cache, batch, scale, sliding_window=window, sinks=sinks, config=config)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("lib", ["cpu", "triton"])
def test_clamped_swiglu_experts_match_reference_and_hf(K, lib, monkeypatch):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(0)
    T, H, F, E, top_k = 9, 32, 16, 4, 2
    cfg = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, swiglu_limit=0.5)
    hf = GptOssExperts(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, top_k, generator=g), dim=-1)
    w_gate_up, w_down = hf.gate_up_proj.detach().transpose(1, 2), hf.down_proj.detach().transpose(1, 2)
    b_gate_up, b_down = hf.gate_up_proj_bias.detach(), hf.down_proj_bias.detach()
    attrs = dict(activation="clamped_swiglu", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    ref = OPS["moe_experts"].reference(None, x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, **attrs)
    with torch.no_grad():
        theirs = hf(x, ids.long(), weights)
    torch.testing.assert_close(ref, theirs, atol=1e-5, rtol=1e-5)
    unclamped = OPS["moe_experts"].reference(None, x, weights, ids, w_gate_up, w_down, b_gate_up, b_down,
                                             **{**attrs, "limit": 1e9})
    assert not torch.allclose(ref, unclamped, atol=1e-3)  # the clamps bite
    kernels = K._ref if lib == "cpu" else K
    if lib == "triton":
        monkeypatch.setattr(K._ref, "moe_experts", None)  # the grouped-GEMM kernels, never their torch fallback
    out = kernels.moe_experts(x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, **attrs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = OPS["moe_experts"].reference(None, x, weights, ids, w_gate_up, w_down)  # no biases, SwiGLU halves
    out = kernels.moe_experts(x, weights, ids, w_gate_up, w_down)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    # bf16: the kernel rounds where torch rounds (GEMM + bias, each activation step), so within a few bf16 steps
    bf = [t.to(torch.bfloat16) for t in (x, w_gate_up, w_down, b_gate_up, b_down)]
    out = kernels.moe_experts(bf[0], weights, ids, *bf[1:], **attrs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.03, rtol=0)  # |ref| <= 1.3: a bf16 step is 2^-7 there
