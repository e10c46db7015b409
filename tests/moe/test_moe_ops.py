"""MoE ops: references and CPU kernels against an independent per-token loop and HF's own router/expert code.

Routers return (weights f32, ids i32). Every consumer must take int32 *and* int64 ids: HF routers hand out
int64 (torch.topk), kiln's hand out int32, and a fused router kernel feeding an experts kernel with the other
integer dtype is exactly the bug class these tests pin down.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from kiln.compiler.ops import OPS

T, H, FF, E, TOPK = 37, 16, 24, 6, 2
ID_DTYPES = (torch.int32, torch.int64)


def _ref(op):
    return lambda *args, **kw: OPS[op].reference(None, *args, **kw)


def per_token_loop(x, weights, ids, w_gate, w_up, w_down):
    """The definition, one (token, slot) at a time."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            xt = x[t].double()
            y = w_down[e].double() @ (F.silu(w_gate[e].double() @ xt) * (w_up[e].double() @ xt))
            out[t] += float(weights[t, k]) * y
    return out.to(x.dtype)


def _experts(seed=0, experts=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate = torch.randn(experts, FF, H, generator=g) * H**-0.5
    w_up = torch.randn(experts, FF, H, generator=g) * H**-0.5
    w_down = torch.randn(experts, H, FF, generator=g) * FF**-0.5
    logits = torch.randn(T, experts, generator=g)
    return x, logits, w_gate, w_up, w_down


# ---------------------------------------------------------------- moe_experts


@pytest.mark.parametrize("ids_dtype", ID_DTYPES)
@pytest.mark.parametrize("fused", [True, False])
def test_experts_reference_and_kernel_match_per_token_loop(K, ids_dtype, fused):
    x, logits, w_gate, w_up, w_down = _experts()
    weights, ids = _ref("moe_topk_softmax")(logits, top_k=TOPK)
    ids = ids.to(ids_dtype)
    mats = (torch.cat([w_gate, w_up], dim=1), w_down) if fused else (w_gate, w_up, w_down)
    expected = per_token_loop(x, weights, ids, w_gate, w_up, w_down)
    torch.testing.assert_close(_ref("moe_experts")(x, weights, ids, *mats), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(K.moe_experts(x, weights, ids, *mats), expected, atol=1e-5, rtol=1e-5)


def test_experts_with_idle_experts_and_a_single_token(K):
    x, _, w_gate, w_up, w_down = _experts(experts=8)
    ids = torch.tensor([[3, 5]] * T, dtype=torch.int32)  # six experts receive nothing
    weights = torch.rand(T, 2)
    gate_up = torch.cat([w_gate, w_up], dim=1)
    expected = per_token_loop(x, weights, ids, w_gate, w_up, w_down)
    torch.testing.assert_close(K.moe_experts(x, weights, ids, gate_up, w_down), expected, atol=1e-5, rtol=1e-5)
    one = K.moe_experts(x[:1], weights[:1], ids[:1].long(), gate_up, w_down)
    torch.testing.assert_close(one, expected[:1], atol=1e-5, rtol=1e-5)


def test_experts_bf16_activations(K):
    x, logits, w_gate, w_up, w_down = _experts()
    weights, ids = K.moe_topk_softmax(logits, top_k=TOPK, renormalize=True)
    bf = [t.bfloat16() for t in (x, torch.cat([w_gate, w_up], 1), w_down)]
    out = K.moe_experts(bf[0], weights, ids, bf[1], bf[2])
    assert out.dtype == torch.bfloat16
    expected = per_token_loop(x, weights, ids, w_gate, w_up, w_down)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- routers vs HF


def _sorted_pairs(weights, ids):
    """Routes as (ids ascending, their weights): HF's topk(sorted=False) may list the k picks in any order."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


def _assert_same_routes(ours, theirs):
    (ids_a, w_a), (ids_b, w_b) = _sorted_pairs(*ours), _sorted_pairs(*theirs)
    assert torch.equal(ids_a, ids_b)
    torch.testing.assert_close(w_a, w_b, atol=1e-6, rtol=1e-5)


def _hf_config(name, **kw):
    import transformers

    return getattr(transformers, name)(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, **kw)


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_hf_qwen3_moe_router(K, renormalize):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = _hf_config("Qwen3MoeConfig", num_experts=E, num_experts_per_tok=TOPK, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    x, *_ = _experts()
    torch.nn.init.normal_(router.weight)
    with torch.no_grad():
        logits, w_hf, ids_hf = router(x)
    for ours in (_ref("moe_topk_softmax")(logits, top_k=TOPK, renormalize=renormalize),
                 K.moe_topk_softmax(logits, top_k=TOPK, renormalize=renormalize)):
        assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int32
        _assert_same_routes(ours, (w_hf, ids_hf))


def test_mixtral_sparse_moe_block_matches_router_plus_experts(K):
    """HF's whole MixtralSparseMoeBlock == linear -> moe_topk_softmax -> moe_experts, for every caller combination
    of router (HF int64 / reference int32 / kernel int32) and experts (reference / kernel, fused or not)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _hf_config("MixtralConfig", intermediate_size=FF, num_local_experts=E, num_experts_per_tok=TOPK)
    block = MixtralSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, *_ = _experts()
    with torch.no_grad():
        expected = block(x[None])[0]
        logits, w_hf, ids_hf = block.gate(x)
    gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
    gate, up = gate_up.chunk(2, dim=1)
    routes = {
        "hf": (w_hf, ids_hf),
        "reference": _ref("moe_topk_softmax")(logits, top_k=TOPK, renormalize=True),
        "kernel": K.moe_topk_softmax(logits, top_k=TOPK, renormalize=True),
    }
    assert routes["hf"][1].dtype == torch.int64 and routes["kernel"][1].dtype == torch.int32
    experts = {"reference": _ref("moe_experts"), "kernel": K.moe_experts}
    for (rname, (w, ids)), (ename, fn), fused in itertools.product(routes.items(), experts.items(), (True, False)):
        mats = (gate_up, down) if fused else (gate, up, down)
        where = f"router {rname} -> experts {ename} (fused={fused})"
        torch.testing.assert_close(fn(x, w, ids, *mats), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, where=where: f"{where}: {m}")


def test_qwen3_moe_sparse_block_matches(K):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _hf_config("Qwen3MoeConfig", moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=TOPK,
                     norm_topk_prob=False)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, *_ = _experts()
    with torch.no_grad():
        expected = block(x[None])[0]
    w, ids = K.moe_topk_softmax(F.linear(x, block.gate.weight), top_k=TOPK, renormalize=False)
    out = K.moe_experts(x, w, ids, block.experts.gate_up_proj.data, block.experts.down_proj.data)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


GROUPED = {
    # DeepSeek-V3: sigmoid, correction bias, top-2-sum group scores, renormalised, scaled
    "v3": dict(top_k=4, n_group=4, topk_group=2, routed_scaling=2.5, renormalize=True, scoring="sigmoid",
               group_score="top2_sum"),
    "v3_one_group": dict(top_k=3, n_group=1, topk_group=1, routed_scaling=1.0, renormalize=False,
                         scoring="sigmoid", group_score="top2_sum"),
    # DeepSeek-V2: softmax, no bias, greedy or group_limited_greedy (max group scores), scaled, not renormalised
    "v2_greedy": dict(top_k=3, n_group=1, topk_group=1, routed_scaling=16.0, renormalize=False, scoring="softmax",
                      group_score="max"),
    "v2_group_limited": dict(top_k=3, n_group=4, topk_group=2, routed_scaling=16.0, renormalize=False,
                             scoring="softmax", group_score="max"),
}
EXPERTS_G = 16


def _hf_grouped_router(kind):
    a = GROUPED[kind]
    if kind.startswith("v3"):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        cfg = _hf_config("DeepseekV3Config", n_routed_experts=EXPERTS_G, num_experts_per_tok=a["top_k"],
                         n_group=a["n_group"], topk_group=a["topk_group"], routed_scaling_factor=a["routed_scaling"],
                         norm_topk_prob=a["renormalize"])
        router = DeepseekV3TopkRouter(cfg)
        torch.nn.init.normal_(router.e_score_correction_bias, std=0.5)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = _hf_config("DeepseekV2Config", n_routed_experts=EXPERTS_G, num_experts_per_tok=a["top_k"],
                         n_group=a["n_group"], topk_group=a["topk_group"], routed_scaling_factor=a["routed_scaling"],
                         topk_method="greedy" if kind == "v2_greedy" else "group_limited_greedy")
        router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    return router


@pytest.mark.parametrize("kind", sorted(GROUPED))
def test_topk_grouped_matches_hf_deepseek_routers(K, kind):
    router = _hf_grouped_router(kind)
    assert router.num_experts == EXPERTS_G
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, w_hf, ids_hf = router(x)
    bias = (router.e_score_correction_bias,) if kind.startswith("v3") else ()
    for ours in (_ref("moe_topk_grouped")(logits, *bias, **GROUPED[kind]),
                 K.moe_topk_grouped(logits, *bias, **GROUPED[kind])):
        assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int32
        _assert_same_routes(ours, (w_hf, ids_hf))


def test_grouped_bias_steers_selection_not_weights(K):
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 4.0])
    w, ids = K.moe_topk_grouped(logits, bias, top_k=2, n_group=1, topk_group=1, routed_scaling=1.0,
                                renormalize=False, scoring="sigmoid", group_score="top2_sum")
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))  # sigmoid(0), unbiased


def test_deepseek_v3_moe_routed_part_matches(K):
    """DeepseekV3MoE minus its shared experts == moe_topk_grouped -> moe_experts, with HF's int64 ids too."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    a = GROUPED["v3"]
    cfg = _hf_config("DeepseekV3Config", n_routed_experts=EXPERTS_G, num_experts_per_tok=a["top_k"],
                     n_group=a["n_group"], topk_group=a["topk_group"], routed_scaling_factor=a["routed_scaling"],
                     norm_topk_prob=True, moe_intermediate_size=FF, n_shared_experts=1)
    moe = DeepseekV3MoE(cfg).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias, std=0.5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = moe(x[None])[0] - moe.shared_experts(x)
        _, w_hf, ids_hf = moe.gate(x)
    logits = F.linear(x, moe.gate.weight)
    mats = (moe.experts.gate_up_proj.data, moe.experts.down_proj.data)
    w, ids = K.moe_topk_grouped(logits, moe.gate.e_score_correction_bias, **a)
    for route in ((w, ids), (w_hf, ids_hf), (w, ids.long()), (w_hf, ids_hf.int())):
        for fn in (K.moe_experts, _ref("moe_experts")):
            torch.testing.assert_close(fn(x, *route, *mats), expected, atol=1e-5, rtol=1e-5)
