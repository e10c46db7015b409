"""place_parallel (passes/place_parallel.py): placements in the IR, before/after as IR text, the collectives of a
dense decoder, the verifier's partial-value rule, `--dump-ir`, and the shapes a mesh cannot split (a grid of
heads x kv_heads x vocab x ffn x tp: every cell a plan or the documented error at the recipe's parallel line).

The numerics of the placed programs (every family, sharded per rank, against Hugging Face) are
test_parallel_parity.py's and test_parallel_gloo.py's; here the interpreter checks that the pass keeps the
global program's meaning (collectives are identities on global values)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from kiln.compiler import VerifyError, parse_program, print_program, verify_program
from kiln.dsl.errors import SourceError
from kiln.passes.place_parallel import PlaceParallel

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from pass_testlib import assert_programs_equal, logits_before_after, run_pass, tiny_llama_ir, typed  # noqa: E402

COLLECTIVES = {"all_reduce", "all_gather", "gather_logits", "dp_gather", "dp_scatter", "all_reduce_add_rms_norm"}


def with_mesh(program, **parallel):
    return dataclasses.replace(program, meta={**program.meta, "parallel": parallel})


BEFORE = """
program p dtype=f32 {
  config {}
  param wq: f32[8, 8] from ["q.weight"]
  param wo: f32[8, 8] from ["o.weight"]
  param bo: f32[8] from ["o.bias"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %wq = param "wq" : f32[8, 8]
    %k = linear(%x, %wq)
    %q = view(%k) {shape=[2, 4]}
    %a = attention(%q, %q, %q)
    %wo = param "wo" : f32[8, 8]
    %bo = param "bo" : f32[8]
    %o = linear(%a, %wo, %bo)
    %h = add(%x, %o)
    return %h
  }
}
"""

# Megatron: the projection into 2 heads of 4 is column-parallel (a head per rank), attention runs on local heads,
# the output projection is row-parallel (a partial sum), reduced before the residual add; its bias once, after.
AFTER = """
program p dtype=f32 {
  config {}
  param wq: f32[8, 8] from ["q.weight"] {sharding={"placement": "S0[2x4]"}}
  param wo: f32[8, 8] from ["o.weight"] {sharding={"placement": "S1[2x4]"}}
  param bo: f32[8] from ["o.bias"]
  graph entry {
    %x = input "x" {placement="R"} : f32[T, 8]
    %wq = param "wq" {placement="S0[2x4]"} : f32[8, 8]
    %k = linear(%x, %wq) {placement="S1[2x4]"}
    %q = view(%k) {placement="S1[2x1]", shape=[2, 4]}
    %a = attention(%q, %q, %q) {placement="S1[2x4]"}
    %wo = param "wo" {placement="S1[2x4]"} : f32[8, 8]
    %bo = param "bo" {placement="R"} : f32[8]
    %o = linear(%a, %wo) {placement="P"}
    %o_reduced = all_reduce(%o) {placement="R"}
    %o_bias = bias_add(%o_reduced, %bo) {placement="R"}
    %h = add(%x, %o_bias) {placement="R"}
    return %h
  }
}
"""


def test_before_after_column_row_parallel_with_bias():
    out, ctx = run_pass(PlaceParallel(), with_mesh(typed(BEFORE), tp=2))
    assert_programs_equal(out, typed(AFTER))
    assert ctx.stats == {"all_reduce": 1, "bias_add": 1}


def test_single_device_is_unchanged():
    program = typed(BEFORE)
    out, _ = run_pass(PlaceParallel(), program)
    assert out is program


@pytest.mark.parametrize("bias", [False, True])
def test_placed_program_computes_the_same(bias):
    before = typed(tiny_llama_ir(bias=bias))
    after, _ = run_pass(PlaceParallel(), with_mesh(before, tp=2))
    assert sum(n.op in COLLECTIVES for g in after.graphs.values() for _, n in g.items()) > 0
    ref, got = logits_before_after(before, after)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_verifier_rejects_a_partial_value_reaching_a_non_reducing_op():
    placed, _ = run_pass(PlaceParallel(), with_mesh(typed(BEFORE), tp=2))
    text = print_program(placed)
    verify_program(parse_program(text), require_types=True)
    bad = text.replace("bias_add(%o_reduced, %bo)", "bias_add(%o, %bo)")
    assert bad != text
    with pytest.raises(VerifyError, match=r"partial \(unreduced\) input 0 \(P\) reaches bias_add"):
        verify_program(parse_program(bad), require_types=True)


# ---------------------------------------------------------------- whole models, through the cpu pipeline

RECIPE = """recipe grid {{
  model   = llama(vocab={vocab}, hidden=64, layers={layers}, heads={heads}, kv_heads={kv_heads}, ffn={ffn})
  weights = random(seed=0)
  target  = cpu
  dtype   = fp32
  parallel {{ {mesh} }}
}}
"""
PARALLEL_LINE = 6


def write_recipe(tmp_path: Path, *, vocab=64, layers=2, heads=4, kv_heads=2, ffn=48, mesh="tp = 2") -> Path:
    path = tmp_path / f"grid-{vocab}-{heads}-{kv_heads}-{ffn}-{mesh.replace(' ', '')}.dsl"
    path.write_text(RECIPE.format(vocab=vocab, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, mesh=mesh))
    return path


def collectives(graph) -> list[str]:
    return [n.op for _, n in graph.items() if n.op in COLLECTIVES]


@pytest.mark.parametrize("vocab", [64, 61])
def test_dense_decoder_has_two_reductions_per_layer(tmp_path, vocab):
    program = kiln.compile(write_recipe(tmp_path, vocab=vocab)).program
    decoder = program.graphs["decoder"]
    ops = collectives(decoder)
    # one after attention's o-projection (fused with the residual add + RMSNorm), one after the MLP's down
    assert ops == ["all_reduce_add_rms_norm", "all_reduce"]
    # nothing between the layer's input and the attention: q/k/v column-parallel, attention on local heads
    (attn,) = [v for v, n in decoder.items() if n.op == "attention"]
    import networkx as nx

    assert not {decoder.node(v).op for v in nx.ancestors(decoder.g, attn)} & COLLECTIVES
    # the vocabulary-parallel embedding's all_reduce and the LM head's gather (vocab 61: padded to 62, the
    # padded columns cut off by the gather; vocab_parallel_sampling made it a gather_logits)
    assert collectives(program.graphs["entry"]) == ["all_reduce", "gather_logits"]
    assert program.params["embed"].sharding["placement"] == ("S0[64x1]" if vocab == 64 else "S0[61x1/62]")
    (gather,) = [n for _, n in program.graphs["entry"].items() if n.op == "gather_logits"]
    assert gather.out.shape == ("T", vocab)


@pytest.mark.parametrize("dense", ["sharded", "replicated"])
def test_dp_attention_dense_mlp_sharded_or_replicated(tmp_path, dense):
    """Data-parallel attention: a sharded dense MLP gathers every rank's rows and reduce-scatters its partial
    output (two collectives a layer); `dense = replicated` keeps each rank's rows and holds the MLP whole (none).
    """
    program = kiln.compile(write_recipe(tmp_path, mesh=f"dp = 2; dense = {dense}")).program
    decoder = program.graphs["decoder"]
    mlp = [n for n in program.params if n.startswith("decoder.") and ("gate" in n or "up" in n or "down" in n)]
    assert mlp, sorted(program.params)
    if dense == "sharded":
        assert collectives(decoder) == ["dp_gather", "dp_scatter"]
        assert all(program.params[n].sharding for n in mlp)
    else:
        assert collectives(decoder) == []
        assert not any(program.params[n].sharding for n in mlp)  # replicated: every rank the whole matrix
        assert {n.attrs["placement"] for _, n in decoder.items() if n.op == "linear"} == {"T"}
    assert collectives(program.graphs["entry"]) == ["dp_gather"]  # the logits rows, once


def test_replicated_dense_mlp_needs_data_parallel_attention(tmp_path):
    with pytest.raises(SourceError, match="parallel.dense = replicated needs data-parallel attention") as e:
        kiln.compile(write_recipe(tmp_path, mesh="tp = 2; dense = replicated"))
    assert e.value.loc.line == PARALLEL_LINE


def test_dump_ir_shows_the_placements(tmp_path):
    from kiln.cli import main

    dump = tmp_path / "ir"
    assert main(["compile", str(write_recipe(tmp_path)), "--dump-ir", str(dump)]) == 0
    (after,) = [p for p in dump.iterdir() if "place_parallel" in p.name]
    text = after.read_text()
    assert 'param decoder.wqkv: f32[128, 64]' in text and '"placement": "S0[4x16,2x16,2x16]"' in text
    assert 'all_reduce(' in text and 'placement="P"' in text


def test_pipeline_parallelism_is_refused_at_its_line(tmp_path):
    with pytest.raises(SourceError, match="pipeline parallelism is not implemented") as e:
        kiln.compile(write_recipe(tmp_path, mesh="pp = 2"))
    assert e.value.loc.line == PARALLEL_LINE


def test_cli_error_is_file_line_col_and_exit_2(tmp_path, capsys):
    from kiln.cli import main

    path = write_recipe(tmp_path, heads=4, kv_heads=2, mesh="tp = 3")
    assert main(["compile", str(path), "-o", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{PARALLEL_LINE}:" in err and "4 query heads" in err and "tp = 3" in err
    assert "Traceback" not in err and not (tmp_path / "art").exists()


# ---------------------------------------------------------------- the grid


def expected_error(heads: int, kv_heads: int, vocab: int, ffn: int, tp: int) -> str | None:
    """The documented rule (README "Tensor parallelism"): query heads and the FFN width split over tp; KV
    heads split (kv_heads % tp == 0) or are replicated (tp % kv_heads == 0); the vocabulary is padded."""
    if heads % tp:
        return f"{heads} query heads"
    if kv_heads % tp and tp % kv_heads:
        return f"{kv_heads} KV heads"
    if ffn % tp:
        return f"{ffn}"
    return None


GRID = [(h, kv, v, f, tp) for h, kv in [(4, 4), (4, 1), (8, 2), (6, 3), (6, 2)] for v in (64, 61)
        for f in (48, 18) for tp in (1, 2, 4, 8)]


def test_grid_every_cell_plans_or_is_a_located_error(tmp_path):
    """80 cells through instantiate -> shape_inference -> place_parallel -> the verifier (the passes that decide
    and check placements); a sample of the valid cells is compiled, loaded and run below."""
    from kiln.compiler import PassContext, verify_program
    from kiln.compiler.instantiate import instantiate_model
    from kiln.compiler.options import recipe_options
    from kiln.dsl import ast as A
    from kiln.dsl.loader import load_recipe
    from kiln.passes.shape_inference import ShapeInference

    loaded = {tp: load_recipe(str(write_recipe(tmp_path, mesh=f"tp = {tp}"))) for tp in (1, 2, 4, 8)}
    seen = {"ok": 0, "error": 0}
    for heads, kv_heads, vocab, ffn, tp in GRID:
        rec = loaded[tp]
        options = recipe_options(rec.recipe)
        loc = rec.model_call.loc
        args = {**dict(rec.model_call.kwargs), **{k: A.Num(v, loc) for k, v in
                                                   dict(vocab=vocab, heads=heads, kv_heads=kv_heads, ffn=ffn).items()}}
        program = instantiate_model(rec.models["llama"], args, "f32", options.to_meta())
        program = ShapeInference().run(program, PassContext())
        want = expected_error(heads, kv_heads, vocab, ffn, tp)
        cell = (heads, kv_heads, vocab, ffn, tp)
        try:
            placed = PlaceParallel().run(program, PassContext())
        except SourceError as e:
            assert want is not None, f"{cell}: refused a valid mesh: {e}"
            assert e.loc.line == PARALLEL_LINE, cell
            assert want in str(e) and f"tp = {tp}" in str(e), f"{cell}: {e}"
            seen["error"] += 1
            continue
        assert want is None, f"{cell}: planned, expected an error naming {want!r}"
        verify_program(placed, require_types=True)
        seen["ok"] += 1
    assert seen["ok"] >= 20 and seen["error"] >= 20, seen


@pytest.mark.parametrize(("heads", "kv_heads", "vocab", "tp"), [(4, 1, 61, 4), (6, 3, 61, 3)])
def test_grid_sample_runs_as_the_single_device_model(tmp_path, heads, kv_heads, vocab, tp, local_mesh):
    """Odd cells end to end: one KV head replicated on all 4 ranks, the vocabulary padded 61 -> 64; 6 query and
    3 KV heads of head_dim 10 over 3 ranks, the vocabulary padded to 63. Same random weights (seed 0): the single-process mesh gives the
    single-device artifact's greedy tokens and prompt logprobs."""
    outs = []
    for t in (1, tp):
        path = write_recipe(tmp_path, vocab=vocab, layers=1, heads=heads, kv_heads=kv_heads, mesh=f"tp = {t}")
        kiln.compile(path, tmp_path / f"art{t}", progress=False)
        with kiln.LLM(str(tmp_path / f"art{t}"), num_kv_blocks=16) as llm:
            prompt = [3, 9, 27, 50, 11, 60]
            o = llm.generate([prompt], kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=0))[0]
            outs.append((o.outputs[0].token_ids, [o.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt)
                                                   if j > 0]))
    assert outs[1][0] == outs[0][0]
    torch.testing.assert_close(torch.tensor(outs[1][1]), torch.tensor(outs[0][1]), atol=1e-4, rtol=0)


def test_report_per_rank_plan_llama3_70b_tp8(tmp_path):
    """`kiln compile --report` of a Llama-3-70B shape at tp = 8 on h200: each rank's weights, KV and
    collectives, and the decode step's communication floor beside its memory floor."""
    path = tmp_path / "l70.dsl"
    path.write_text("""recipe l70 {
  model   = llama(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, rope_theta=500000.0)
  weights = random(seed=0)
  target  = h200
  dtype   = bf16
  parallel { tp = 8 }
}
""")
    report = kiln.compile(path).report
    h, f, v, layers, hd = 8192, 28672, 128256, 80, 128
    per_layer = (h * h + 2 * 8 * hd * h + h * h + 3 * f * h) // 8 + 2 * h  # sharded projections, replicated norms
    rank_bytes = 2 * (2 * v * h // 8 + layers * per_layer + h)
    assert f"parameter bytes        {rank_bytes:,} B" in report
    assert f"KV bytes per token     {layers * 1 * hd * 2 * 2:,} B" in report  # one of the 8 KV heads per rank
    lines = report.split("parallel plan", 1)[1].splitlines()
    assert sum("decoder x80" in line for line in lines) == 2
    assert any("gather_logits" in line and f"{v * 4:,} B per row" in line for line in lines)  # fp32 logits, at most
    wire = 2 * 7 / 8 * h * 2 * (1 + 2 * layers) + 7 / 8 * v * 4
    assert f"communication floor {wire / 900e9 * 1e6:,.2f} us" in report
    assert f"memory floor {rank_bytes / 4.8e12 * 1e6:,.2f} us" in report


FUSE_BEFORE = """
program p dtype=f32 {
  config {}
  param w: f32[8] from ["n.weight"]
  graph entry {
    %x = input "x" {placement="P"} : f32[T, 8]
    %h = input "h" {placement="R"} : f32[T, 8]
    %w = param "w" {placement="R"} : f32[8]
    %r = all_reduce(%x) {placement="R"}
    %t = add_rms_norm(%h, %r, %w) {eps=1e-05, placement="(R, R)"}
    %n = getitem(%t) {index=0, placement="R"}
    %s = getitem(%t) {index=1, placement="R"}
    %o = add(%n, %s) {placement="R"}
    return %o
  }
}
"""

FUSE_AFTER = """
program p dtype=f32 {
  config {}
  param w: f32[8] from ["n.weight"]
  graph entry {
    %x = input "x" {placement="P"} : f32[T, 8]
    %h = input "h" {placement="R"} : f32[T, 8]
    %w = param "w" {placement="R"} : f32[8]
    %t = all_reduce_add_rms_norm(%x, %h, %w) {eps=1e-05, placement="(R, R)"}
    %n = getitem(%t) {index=0, placement="R"}
    %s = getitem(%t) {index=1, placement="R"}
    %o = add(%n, %s) {placement="R"}
    return %o
  }
}
"""


def test_fuse_all_reduce_add_rms_norm_before_after():
    from kiln.passes.fuse_all_reduce_add_rms_norm import FuseAllReduceAddRMSNorm

    out, _ = run_pass(FuseAllReduceAddRMSNorm(), typed(FUSE_BEFORE))
    assert_programs_equal(out, typed(FUSE_AFTER))
    # an all_reduce read twice stays: its other reader needs the reduced value
    twice = FUSE_BEFORE.replace("%o = add(%n, %s)", "%o = add(%n, %r)")
    out, _ = run_pass(FuseAllReduceAddRMSNorm(), typed(twice))
    assert "all_reduce_add_rms_norm" not in print_program(out)
