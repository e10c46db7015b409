"""The cpu pipeline: order, disabling, and end-to-end numerics on a two-layer Llama-like program."""
import pytest
import torch
from kiln.compiler import PassContext, PassError, PassManager, parse_program, print_program
from kiln.passes import build_pipeline, kernel_selection
from pass_testlib import logits_before_after, tiny_llama_ir, typed

CPU = ["shape_inference", "quantize_weights", "fuse_qkv", "fuse_gate_up", "fuse_expert_gate_up", "fuse_silu_mul",
       "fuse_add_rms_norm", "mla_absorption", "fuse_dequant_linear", "quantize_kv_cache", "fuse_rope_kv_write", "dead_code_elimination",
       "kernel_selection"]


def test_cpu_pipeline_order():
    assert [p.name for p in build_pipeline("cpu")] == CPU
    assert PassManager.for_target("cpu").names == CPU


def test_disabled_passes_are_left_out():
    names = [p.name for p in build_pipeline("cpu", disable=["fuse_qkv", "fuse_silu_mul"])]
    assert names == [n for n in CPU if n not in ("fuse_qkv", "fuse_silu_mul")]


def test_unknown_target_or_pass_is_an_error():
    with pytest.raises(PassError, match="target 'tpu' has no pass pipeline yet"):
        build_pipeline("tpu")
    with pytest.raises(PassError, match="cannot disable"):
        build_pipeline("cpu", disable=["fuse_qvk"])


def test_gpu_targets_lower_with_their_kernel_tables():
    for target in ("h100", "h200"):
        assert [p.name for p in build_pipeline(target)] == [*CPU, "cuda_graph_plan"]
        lowering, planning = build_pipeline(target)[-2:]
        assert lowering.name == "kernel_selection" and lowering.target == target
    table = kernel_selection.kernel_table("h200")
    assert table["attention"] == "triton.paged_attention" and table["linear"] == "torch.linear"
    assert set(table) == set(kernel_selection.kernel_table("cpu"))  # every cpu op has a GPU kernel id


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_full_pipeline_keeps_logits_and_selects_every_kernel(bias, tmp_path):
    before = typed(tiny_llama_ir(bias))
    ctx = PassContext(target="cpu", dump_dir=tmp_path)
    after = PassManager.for_target("cpu").run(before, ctx)

    ref, got = logits_before_after(before, after, seed=5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    for graph in after.graphs.values():
        for vid, node in graph.items():
            assert "kernel" in node.attrs, f"%{vid} = {node.op} has no kernel"
    decoder = after.graphs["decoder"]
    assert decoder.count("linear") == 4  # qkv, o, gate_up, down
    assert (decoder.count("silu_mul"), decoder.count("add_rms_norm")) == (1, 1)
    fused = {"decoder.wqkv", "decoder.wgate_up"} | ({"decoder.bqkv"} if bias else set())
    assert fused <= set(after.params)
    assert {r.name: r.stats.get("matches") for r in ctx.log if r.name.startswith("fuse_")} == {
        "fuse_qkv": 1, "fuse_gate_up": 1, "fuse_expert_gate_up": 0, "fuse_silu_mul": 1, "fuse_add_rms_norm": 1,
        "fuse_dequant_linear": 0, "fuse_rope_kv_write": 1}

    # the dump after the last pass reads back as the same program
    last = max(tmp_path.glob("*.ir"))
    assert last.name == f"{len(CPU):02d}_kernel_selection.ir"
    assert print_program(parse_program(last.read_text())) == print_program(after)
