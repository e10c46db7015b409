"""quantize_weights, fuse_dequant_linear and quantize_kv_cache on the passes' tiny Llama IR."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kiln.compiler import PassContext, PassError, PassManager, verify_program
from kiln.compiler.interpret import interpret
from kiln.compiler.options import parse_weight_scheme
from kiln.compiler.quant import fp8_quantize
from kiln.passes.fuse_dequant_linear import FuseDequantLinear
from kiln.passes.quantize_kv_cache import QuantizeKVCache
from kiln.passes.quantize_weights import QuantizeWeights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from pass_testlib import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    random_checkpoint,
    run_pass,
    tiny_llama_ir,
    tokens,
    typed,
    weights_from_checkpoint,
)


def _quantized_weights(program, ckpt):
    """Interpreter weights of a program whose fp8 params (quant role weight/weight_scale) quantize the checkpoint."""
    plain = {s.name: s for s in program.params.values() if s.quant is None}
    weights = weights_from_checkpoint(program.with_params(plain), ckpt)
    for spec in program.params.values():
        q = spec.quant
        if q is None:
            continue
        layers = range(program.blocks[spec.block].count) if spec.block else [None]
        for i in layers:
            w_q, s = fp8_quantize(ckpt[spec.sources_for(i)[0]], q["granularity"], q["block"])
            weights[spec.layer_name(i)] = w_q if q["role"] == "weight" else s
    return weights


def test_no_quantize_option_changes_nothing():
    before = typed(tiny_llama_ir())
    for p in (QuantizeWeights(), FuseDequantLinear(), QuantizeKVCache()):
        out, _ = run_pass(p, before)
        assert out is before


@pytest.mark.parametrize("scheme", ["fp8", {"kind": "fp8", "args": [], "per_channel": True},
                                    {"kind": "fp8", "args": [], "block": 16}])
def test_fp8_weights_then_fusion_keep_meaning(scheme):
    before = typed(tiny_llama_ir(bias=True))
    q, ctx = run_pass(QuantizeWeights(parse_weight_scheme(scheme)), before)
    decoder = q.graphs["decoder"]
    assert decoder.count("dequant_fp8") == 7 and decoder.count("linear") == 7  # q k v o gate up down
    assert ctx.stats["matches"] == 7 and q.entry.count("dequant_fp8") == 0  # embedding / lm head untouched
    assert q.params["decoder.wq_fp8"].dtype == "fp8e4m3" and q.params["decoder.wq_scale"].quant["role"] == "weight_scale"
    assert "decoder.wq" not in q.params
    fused, fctx = run_pass(FuseDequantLinear(), q)
    assert fctx.stats["matches"] == 7
    assert fused.graphs["decoder"].count("linear_fp8") == 7 and fused.graphs["decoder"].count("dequant_fp8") == 0
    ckpt = random_checkpoint(before, seed=3)
    w = _quantized_weights(q, ckpt)
    unfused, fused_logits = interpret(q, w, tokens()), interpret(fused, w, tokens())
    torch.testing.assert_close(fused_logits, unfused, rtol=0, atol=1e-5)
    ref = interpret(before, weights_from_checkpoint(before, ckpt), tokens())
    assert (unfused - ref).abs().max() < 0.1 * ref.abs().max()  # fp8 error, not garbage


def test_quantized_linears_merge_and_pipeline_lowers_them():
    before = typed(tiny_llama_ir())
    ctx = PassContext(options={"quantize": {"weights": "fp8", "kv_cache": "fp8"}})
    after = PassManager.for_target("cpu").run(before, ctx)
    verify_program(after, require_types=True)
    decoder = after.graphs["decoder"]
    assert decoder.count("linear_fp8") == 4  # qkv, o, gate_up, down
    assert after.params["decoder.wqkv_scale"].shape == (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM,)
    assert "decoder.wq_fp8" not in after.params and "decoder.wgate_up_fp8" in after.params
    (attn,) = [n for _, n in decoder.items() if n.op == "attention"]
    assert attn.attrs["kv_dtype"] == "fp8e4m3" and len(attn.inputs) == 5
    assert after.params["decoder.k_scale"].source == ("model.layers.{i}.self_attn.k_scale",)
    assert {n.attrs["kernel"] for _, n in decoder.items() if n.op == "linear_fp8"} == {"cpu.linear_fp8"}


def test_kv_pass_after_qkv_fusion_finds_the_checkpoint_prefix():
    ctx = PassContext(options={"quantize": {"kv_cache": "fp8"}})
    after = PassManager.for_target("cpu").run(typed(tiny_llama_ir()), ctx)
    assert "decoder.wqkv" in after.params  # fusion still happens with an unquantized weight
    assert after.params["decoder.v_scale"].quant["alt_sources"] == ("model.layers.{i}.self_attn.v_proj.output_scale",)


def test_bad_scheme_is_a_pass_error():
    with pytest.raises(PassError, match="unknown weight quantization 'nf4'"):
        run_pass_ctx = PassContext(options={"quantize": {"weights": "nf4"}})
        QuantizeWeights().run(typed(tiny_llama_ir()), run_pass_ctx)
