"""fuse_qkv / fuse_gate_up over quantized weights: which schemes merge (fp8 all granularities, int4 AWQ),
which stay separate (GPTQ; fp8 blocks straddling two projections), the merged IR, and that a merged artifact
computes the logits of the unmerged one (same checkpoint, `passes { disable = [...] }`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_qkv import FuseQKV
from quant_testlib import awq_checkpoint, log_probs, recipe_text

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from pass_testlib import assert_programs_equal, run_pass, run_pass_on_text, typed  # noqa: E402


def _scale_shape(rows: int, granularity: str, block: int) -> str:
    """The scale of an fp8 [rows, 8] weight: [1], [rows], or [ceil(rows/B), ceil(8/B)] blocks."""
    return {"tensor": "1", "channel": f"{rows}"}.get(granularity) or f"{-(-rows // block)}, {-(-8 // block)}"


def _fp8(name: str, rows: int, src: str, granularity: str = "tensor", block: int = 0) -> str:
    q = (f'"scheme": "fp8", "granularity": "{granularity}", "block": {block}, "of": "{name}", '
         f'"weight_shape": [{rows}, 8], "dtype": "f32"')
    scale = _scale_shape(rows, granularity, block)
    return (f'  param {name}_fp8: fp8e4m3[{rows}, 8] from ["{src}"] {{quant={{{q}, "role": "weight"}}}}\n'
            f'  param {name}_scale: f32[{scale}] from ["{src}"] {{quant={{{q}, "role": "weight_scale"}}}}\n')


ATTENTION_TAIL = """
    %q = view(%q0) {shape=[2, 4]}
    %k = view(%k0) {shape=[1, 4]}
    %v = view(%v0) {shape=[1, 4]}
    %a = attention(%q, %k, %v)
    return %a
  }
}
"""


def _fp8_qkv_before(granularity: str = "tensor", block: int = 0) -> str:
    nodes = ""
    for r, rows in (("q", 8), ("k", 4), ("v", 4)):
        s = _scale_shape(rows, granularity, block)
        nodes += (f'    %w{r} = param "w{r}_fp8" : fp8e4m3[{rows}, 8]\n'
                  f'    %s{r} = param "w{r}_scale" : f32[{s}]\n'
                  f'    %dq{r} = dequant_fp8(%w{r}, %s{r}) {{granularity="{granularity}", block={block}, dtype="f32"}}\n'
                  f'    %{r}0 = linear(%x, %dq{r})\n')
    params = "".join(_fp8(f"w{r}", rows, f"{r}.weight", granularity, block)
                     for r, rows in (("q", 8), ("k", 4), ("v", 4)))
    return ("program p dtype=f32 {\n  config {}\n" + params + "  graph entry {\n"
            '    %x = input "x" : f32[T, 8]\n' + nodes + ATTENTION_TAIL)


# q (8 rows), k and v (4 rows each), per-tensor scales -> one [16, 8] e4m3 weight whose scale has one entry
# per row; the dequant becomes per-channel; the converter builds it from `parts`
FP8_QKV_EXPECTED = """
program p dtype=f32 {
  config {}
  param wqkv_fp8: fp8e4m3[16, 8] from ["q.weight", "k.weight", "v.weight"] {quant={"scheme": "fp8", "granularity": "tensor", "block": 0, "of": "wqkv", "weight_shape": [16, 8], "dtype": "f32", "role": "weight", "parts": [["wq", 8], ["wk", 4], ["wv", 4]]}}
  param wqkv_scale: f32[16] from ["q.weight", "k.weight", "v.weight"] {quant={"scheme": "fp8", "granularity": "tensor", "block": 0, "of": "wqkv", "weight_shape": [16, 8], "dtype": "f32", "role": "weight_scale", "parts": [["wq", 8], ["wk", 4], ["wv", 4]]}}
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "wqkv_fp8" : fp8e4m3[16, 8]
    %s = param "wqkv_scale" : f32[16]
    %dq = dequant_fp8(%w, %s) {granularity="channel", block=0, dtype="f32"}
    %qkv = linear(%x, %dq)
    %q0 = slice(%qkv) {start=0, stop=8}
    %k0 = slice(%qkv) {start=8, stop=12}
    %v0 = slice(%qkv) {start=12, stop=16}
""" + ATTENTION_TAIL


def test_fp8_qkv_merge_ir():
    before, after, ctx = run_pass_on_text(FuseQKV(), _fp8_qkv_before())
    assert ctx.stats["matches"] == 1 and ctx.stats["by_rewrite"] == {"qkv_dequant_fp8": 1}
    assert_programs_equal(after, typed(FP8_QKV_EXPECTED))


def test_fp8_block_straddling_projections_is_not_merged():
    # block 8: q's 8 rows are one block row, but k's 4 rows would share a block row with v's
    before, after, ctx = run_pass_on_text(FuseQKV(), _fp8_qkv_before("block", 8))
    assert after is before and ctx.stats.get("matches", 0) == 0
    _, merged, _ = run_pass_on_text(FuseQKV(), _fp8_qkv_before("block", 4))  # 4 divides every part
    assert merged.params["wqkv_scale"].shape == (4, 2)  # block rows 2 (q) + 1 (k) + 1 (v); K = 8 is 2 blocks


def _int4_gate_up(fmt: str) -> str:
    """gate/up [16, 32] in `fmt` (group 16), as quantize_weights leaves them."""
    params, nodes = "", ""
    for r in ("gate", "up"):
        q = (f'"scheme": "{fmt}", "group": 16, "of": "w_{r}", "weight_shape": [16, 32], "dtype": "f32"')
        shapes = {"qweight": "[32, 2]" if fmt == "awq" else "[4, 16]", "qzeros": "[2, 2]", "scales": "[2, 16]",
                  "g_idx": "[32]"}
        roles = ("qweight", "qzeros", "scales") + (("g_idx",) if fmt == "gptq" else ())
        for role in roles:
            dtype = "f16" if role == "scales" else "i32"
            params += (f'  param w_{r}_{role}: {dtype}{shapes[role]} from ["{r}.{role}"] '
                       f'{{quant={{{q}, "role": "{role}"}}}}\n')
            nodes += f'    %{r}_{role} = param "w_{r}_{role}" : {dtype}{shapes[role]}\n'
        zo = 0 if fmt == "awq" else 1
        nodes += (f'    %dq_{r} = dequant_int4({", ".join(f"%{r}_{role}" for role in roles)}) '
                  f'{{format="{fmt}", group=16, zero_offset={zo}, dtype="f32"}}\n'
                  f'    %{r} = linear(%x, %dq_{r})\n')
    return ("program p dtype=f32 {\n  config {}\n" + params + "  graph entry {\n"
            '    %x = input "x" : f32[T, 32]\n' + nodes
            + "    %act = silu(%gate)\n    %m = mul(%act, %up)\n    return %m\n  }\n}\n")


# AWQ packs output columns along dim 1 in whole int32 words: qweight [32, 2] + [32, 2] -> [32, 4] (etc.)
AWQ_GATE_UP_EXPECTED = """
program p dtype=f32 {
  config {}
  param wgate_up_qweight: i32[32, 4] from ["gate.qweight", "up.qweight"] {concat_dim=1, quant={"scheme": "awq", "group": 16, "of": "wgate_up", "weight_shape": [32, 32], "dtype": "f32", "role": "qweight", "parts": [["w_gate", 16], ["w_up", 16]]}}
  param wgate_up_qzeros: i32[2, 4] from ["gate.qzeros", "up.qzeros"] {concat_dim=1, quant={"scheme": "awq", "group": 16, "of": "wgate_up", "weight_shape": [32, 32], "dtype": "f32", "role": "qzeros", "parts": [["w_gate", 16], ["w_up", 16]]}}
  param wgate_up_scales: f16[2, 32] from ["gate.scales", "up.scales"] {concat_dim=1, quant={"scheme": "awq", "group": 16, "of": "wgate_up", "weight_shape": [32, 32], "dtype": "f32", "role": "scales", "parts": [["w_gate", 16], ["w_up", 16]]}}
  graph entry {
    %x = input "x" : f32[T, 32]
    %qw = param "wgate_up_qweight" : i32[32, 4]
    %qz = param "wgate_up_qzeros" : i32[2, 4]
    %sc = param "wgate_up_scales" : f16[2, 32]
    %dq = dequant_int4(%qw, %qz, %sc) {format="awq", group=16, zero_offset=0, dtype="f32"}
    %gate_up = linear(%x, %dq)
    %gate = slice(%gate_up) {start=0, stop=16}
    %up = slice(%gate_up) {start=16, stop=32}
    %act = silu(%gate)
    %m = mul(%act, %up)
    return %m
  }
}
"""


def test_awq_gate_up_merge_ir():
    _, after, ctx = run_pass_on_text(FuseGateUp(), _int4_gate_up("awq"))
    assert ctx.stats["matches"] == 1
    assert_programs_equal(after, typed(AWQ_GATE_UP_EXPECTED))


def test_gptq_is_not_merged():
    before = typed(_int4_gate_up("gptq"))
    after, ctx = run_pass(FuseGateUp(), before)
    assert after is before and ctx.stats.get("matches", 0) == 0


# ---------------------------------------------------------------- merged vs unmerged artifacts


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", hidden_size=128, intermediate_size=256)


def _build(ckpt: Path, out: Path, quantize: str, merged: bool) -> Path:
    text = recipe_text(ckpt, quantize)
    if not merged:
        text = text[:text.rindex("}")] + '  passes { disable = ["fuse_qkv", "fuse_gate_up"] }\n}\n'
    recipe = out.parent / f"{out.name}.dsl"
    recipe.write_text(text)
    kiln.compile(recipe, out, progress=False)
    return out


@pytest.mark.parametrize("quantize", ["fp8", "fp8(block=128)", "fp8(act=dynamic)", "awq(group=128)"])
def test_merged_artifact_has_the_unmerged_logits(quantize, ckpt, tmp_path):
    src = awq_checkpoint(ckpt, tmp_path / "awq_ckpt") if quantize.startswith("awq") else ckpt
    merged = _build(src, tmp_path / "merged", f"weights = {quantize}", merged=True)
    plain = _build(src, tmp_path / "plain", f"weights = {quantize}", merged=False)
    tokens = torch.randint(5, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got, ref = log_probs(merged, tokens), log_probs(plain, tokens)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    # the merge happened (fp8 block=128: not for q/k/v, whose k and v have 64 rows)
    params = {p["name"] for p in json.loads((merged / "manifest.json").read_text())["params"]}
    plain_params = {p["name"] for p in json.loads((plain / "manifest.json").read_text())["params"]}
    fused = {n for n in params if "gate_up" in n}
    assert fused and not {n for n in plain_params if "gate_up" in n or "qkv" in n}
    assert any("qkv" in n for n in params) == (quantize != "fp8(block=128)")
