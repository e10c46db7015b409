"""LoRA on a tensor-parallel mesh, compiler side: lora_injection after place_parallel places each branch as its
linear (IR before/after as text), the verifier's `lora` placement rule, each rank's slice of the adapter slots in
the manifest (`lora.targets[].shard`), and the recipe refusals that remain (dp, ep).

Why adding each rank's branch into its partial sum is exact for a row-parallel linear: x = [x_0 | x_1] by
columns, A = [A_0 | A_1] likewise, so x A^T = x_0 A_0^T + x_1 A_1^T and (x A^T) B^T = sum_k (x_k A_k^T) B^T — the
base's all_reduce sums the branch with the GEMM's partials; no collective of its own (checked numerically here,
and end to end in tests/lora/test_lora_tensor_parallel.py)."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from kiln.compiler import VerifyError, verify_program
from kiln.compiler.placement import Mesh, lora_local_rows, lora_shard, parse_placement, shard_tensor
from kiln.dsl.errors import SourceError
from kiln.passes.lora_injection import LoRAInjection
from kiln.passes.place_parallel import PlaceParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))
from lora_testlib import lora_recipe  # noqa: E402
from pass_testlib import assert_programs_equal, run_pass, typed  # noqa: E402

LAYER = "model.layers.{i}.self_attn"
QKV_SOURCES = f'["{LAYER}.q_proj.weight", "{LAYER}.k_proj.weight", "{LAYER}.v_proj.weight"]'
QKV = f'modules=["{LAYER}.q_proj", "{LAYER}.k_proj", "{LAYER}.v_proj"], rows=[8, 4, 4], max_rank=4'
O_PROJ = f'modules=["{LAYER}.o_proj"], rows=[8], max_rank=4'

# A decoder block: fused q/k/v into 2 query heads and 1 KV head of 4, attention, output projection, residual.
BEFORE = f"""
program p dtype=f32 {{
  config {{}}
  param decoder.wqkv: f32[16, 8] from {QKV_SOURCES} {{block="decoder"}}
  param decoder.wo: f32[8, 8] from ["{LAYER}.o_proj.weight"] {{block="decoder"}}
  block decoder = decoder x 2
  graph entry {{
    %x = input "x" : f32[T, 8]
    %h = block(%x) {{block="decoder"}}
    return %h
  }}
  graph decoder {{
    %x = input "x" : f32[T, 8]
    %w = param "decoder.wqkv" : f32[16, 8]
    %y = linear(%x, %w)
    %q0 = slice(%y) {{start=0, stop=8}}
    %k0 = slice(%y) {{start=8, stop=12}}
    %v0 = slice(%y) {{start=12, stop=16}}
    %q = view(%q0) {{shape=[2, 4]}}
    %k = view(%k0) {{shape=[1, 4]}}
    %v = view(%v0) {{shape=[1, 4]}}
    %a = attention(%q, %k, %v)
    %wo = param "decoder.wo" : f32[8, 8]
    %o = linear(%a, %wo)
    %h = add(%x, %o)
    return %h
  }}
}}
"""

# tp = 2: q/k/v column-parallel (a query head per rank; the one KV head replicated on both), its branch placed as
# its output (each rank's B: its rows of q, and k and v whole); o row-parallel, its branch partial like the GEMM
# (each rank's A: its 4 input columns) and summed by the same all_reduce, before the residual add.
QKV_PL = "S1[2x4,1x4,1x4]"
EXPECTED = f"""
program p dtype=f32 {{
  config {{}}
  param decoder.wqkv: f32[16, 8] from {QKV_SOURCES} {{block="decoder", sharding={{"placement": "S0[2x4,1x4,1x4]"}}}}
  param decoder.wo: f32[8, 8] from ["{LAYER}.o_proj.weight"] {{block="decoder", sharding={{"placement": "S1[2x4]"}}}}
  block decoder = decoder x 2
  graph entry {{
    %x = input "x" {{placement="R"}} : f32[T, 8]
    %h = block(%x) {{block="decoder", placement="R"}}
    return %h
  }}
  graph decoder {{
    %x = input "x" {{placement="R"}} : f32[T, 8]
    %w = param "decoder.wqkv" {{placement="S0[2x4,1x4,1x4]"}} : f32[16, 8]
    %y0 = linear(%x, %w) {{placement="{QKV_PL}"}}
    %y = lora(%x, %y0) {{placement="{QKV_PL}", target="decoder.wqkv", {QKV}}}
    %q0 = slice(%y) {{placement="S1[2x4]", start=0, stop=8}}
    %k0 = slice(%y) {{placement="S1[1x4]", start=8, stop=12}}
    %v0 = slice(%y) {{placement="S1[1x4]", start=12, stop=16}}
    %q = view(%q0) {{placement="S1[2x1]", shape=[2, 4]}}
    %k = view(%k0) {{placement="S1[1x1]", shape=[1, 4]}}
    %v = view(%v0) {{placement="S1[1x1]", shape=[1, 4]}}
    %a = attention(%q, %k, %v) {{placement="S1[2x4]"}}
    %wo = param "decoder.wo" {{placement="S1[2x4]"}} : f32[8, 8]
    %o0 = linear(%a, %wo) {{placement="P"}}
    %o = lora(%a, %o0) {{placement="P", target="decoder.wo", {O_PROJ}}}
    %o_reduced = all_reduce(%o) {{placement="R"}}
    %h = add(%x, %o_reduced) {{placement="R"}}
    return %h
  }}
}}
"""


def _tp(program, tp: int):
    return dataclasses.replace(program, meta={**program.meta, "parallel": {"tp": tp}})


def _placed_with_lora(tp: int = 2):
    placed, _ = run_pass(PlaceParallel(), _tp(typed(BEFORE), tp))
    return run_pass(LoRAInjection(max_rank=4), placed)


def test_before_after_branches_placed_as_their_linears():
    out, ctx = _placed_with_lora()
    assert ctx.stats["adapted"] == 2
    assert_programs_equal(out, _tp(typed(EXPECTED), 2))


def test_single_device_program_gets_unplaced_branches():
    out, _ = run_pass(LoRAInjection(max_rank=4), typed(BEFORE))  # nothing placed: no placement attrs added
    assert all("placement" not in n.attrs for _, n in out.graphs["decoder"].items())


@pytest.mark.parametrize(("old", "new", "why"), [
    # a row-parallel branch is partial (each rank's summand), never a replicated value
    ('%o = lora(%a, %o0) {placement="P"', '%o = lora(%a, %o0) {placement="R"', "is placed R"),
    ('%y = lora(%x, %y0) {placement="S1[2x4,1x4,1x4]"', '%y = lora(%x, %y0) {placement="R"', "is placed R"),
    # a whole input with a partial output: neither column- nor row-parallel
    ('%o = lora(%a, %o0)', '%o = lora(%x, %o0)', "lora reads its linear's input and output"),
])
def test_verifier_checks_branch_placements(old, new, why):
    text = EXPECTED.replace(old, new)
    assert text != EXPECTED
    with pytest.raises(VerifyError, match=why):
        verify_program(_tp(typed(text), 2))


def test_lora_shard_ranges_and_local_rows():
    out, _ = _placed_with_lora()
    g = out.graphs["decoder"]
    loras = {n.attrs["target"]: n for _, n in g.items() if n.op == "lora"}
    mesh = Mesh(tp=2)
    # q rows 0-3 | 4-7 split by head, the one KV head (rows 8-11 of k, 12-15 of v) on both ranks
    assert lora_shard(g, loras["decoder.wqkv"], mesh) == {"dim": 0, "ranges": [[[0, 4], [8, 16]], [[4, 16]]]}
    assert lora_local_rows(g, loras["decoder.wqkv"], mesh) == (4, 4, 4)
    assert lora_shard(g, loras["decoder.wo"], mesh) == {"dim": 1, "ranges": [[[0, 4]], [[4, 8]]]}
    assert lora_local_rows(g, loras["decoder.wo"], mesh) == (8,)


def test_row_parallel_branch_summed_by_the_reduction_is_exact():
    """(x A^T) B^T == sum over ranks of (x_k A_k^T) B^T with x and A cut as the row-parallel placement cuts them
    (shard_tensor: what each rank holds), and the column-parallel branch is its rows of the whole one."""
    torch.manual_seed(0)
    mesh = Mesh(tp=2)
    x, a, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), \
        torch.randn(8, 3, dtype=torch.float64)
    whole = (x @ a.T) @ b.T
    cols = parse_placement("S1[2x4]")
    parts = [(shard_tensor(x, cols, mesh, r) @ shard_tensor(a, cols, mesh, r).T) @ b.T for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-12, rtol=0)
    rows = parse_placement("S0[2x4]")
    for r in range(2):
        torch.testing.assert_close((x @ a.T) @ shard_tensor(b, rows, mesh, r).T,
                                   shard_tensor(whole, parse_placement("S1[2x4]"), mesh, r), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- the tiny llama compiled for tp = 2 and 4


SERVE_LINE = "  serve     {"


def parallel_edit(mesh: str) -> tuple[str, str]:
    """The recipe edit adding `parallel { mesh }` (a `conftest` import would find another directory's conftest
    when the whole suite runs)."""
    return SERVE_LINE, f"  parallel  {{ {mesh} }}\n{SERVE_LINE}"


def _manifest(compile_hf, mesh: str) -> dict:
    edit = ("  serve     {", "  lora { max_loras = 2; max_rank = 8 }\n  serve     {")
    _, art, _ = compile_hf("llama", edits=(parallel_edit(mesh), edit))
    return json.loads((art / "manifest.json").read_text())


@pytest.mark.parametrize("tp", [2, 4])
def test_manifest_gives_each_rank_its_slice(tp, compile_hf):
    """Tiny llama: hidden 64 = 4 heads of 16, 2 KV heads, FFN 128. q/k/v and gate/up: B's rows per rank (KV heads
    replicated on 2 ranks at tp = 4); o and down: A's columns per rank."""
    targets = {t["name"]: t for t in _manifest(compile_hf, f"tp = {tp}")["lora"]["targets"]}
    assert set(targets) == {"decoder.wqkv", "decoder.wo", "decoder.wgate_up", "decoder.w_down"}
    q, kv, ffn = 64 // tp, 16 * max(1, 2 // tp), 128 // tp
    kv_head = [r * 2 // tp for r in range(tp)]  # the KV head rank r holds
    want_qkv = [[[q * r, q * (r + 1)], [64 + kv * kv_head[r], 64 + kv * kv_head[r] + kv],
                 [96 + kv * kv_head[r], 96 + kv * kv_head[r] + kv]] for r in range(tp)]
    assert targets["decoder.wqkv"]["rows"] == [64, 32, 32]
    assert targets["decoder.wqkv"]["shard"] == {"dim": 0, "ranges": want_qkv}
    assert targets["decoder.wo"]["shard"] == {"dim": 1, "ranges": [[[q * r, q * (r + 1)]] for r in range(tp)]}
    assert targets["decoder.wgate_up"]["shard"] == {
        "dim": 0, "ranges": [[[ffn * r, ffn * (r + 1)], [128 + ffn * r, 128 + ffn * (r + 1)]] for r in range(tp)]}
    assert targets["decoder.w_down"]["shard"] == {"dim": 1, "ranges": [[[ffn * r, ffn * (r + 1)]] for r in range(tp)]}


@pytest.mark.parametrize(("mesh", "key"), [("dp = 2", "parallel.dp"), ("tp = 2; ep = 2", "parallel.ep")])
def test_lora_with_dp_or_ep_is_refused_at_the_parallel_line(mesh, key, tiny_checkpoint, tmp_path):
    import kiln
    from kiln.cli import main

    arch = "llama" if "ep" not in mesh else "mixtral"
    recipe = tmp_path / "recipe.dsl"
    assert main(["recipe", "from-hf", str(tiny_checkpoint(arch)), "-o", str(recipe)]) == 0
    old, new = parallel_edit(mesh)
    recipe.write_text(lora_recipe(recipe.read_text().replace(old, new, 1), "max_loras = 2; max_rank = 8"))
    with pytest.raises(SourceError, match=f"LoRA with {key}") as e:
        kiln.compile(recipe, tmp_path / "art", progress=False)
    line = next(i for i, t in enumerate(recipe.read_text().splitlines(), 1) if "parallel" in t)
    assert e.value.loc.line == line


def test_gpu_model_passes_each_rank_its_module_rows(compile_hf):
    """The h200 artifact's Triton lora call gets a rank's rows of each module (the kernel's slices of y), not the
    global ones: tp = 2 holds 32 of q's 64 rows and 16 of k's and v's 32, 64 of gate's and up's 128; o and down
    (row-parallel) keep their 64 output rows."""
    edits = (parallel_edit("tp = 2"), ("target  = cpu", "target  = h200"),
             ("  serve     {", "  lora { max_loras = 2; max_rank = 8 }\n  serve     {"))
    _, art, _ = compile_hf("llama", edits=edits)
    calls = [line.strip() for line in (art / "model.py").read_text().splitlines() if "K.lora(" in line]
    rows = dict(re.search(r"batch\.lora, \"([^\"]+)\", layer, rows=(\([^)]*\))", line).groups() for line in calls)
    assert rows == {"decoder.wqkv": "(32, 16, 16)", "decoder.wo": "(64,)", "decoder.wgate_up": "(64, 64)",
                    "decoder.w_down": "(64,)"}
