"""The cpu pipeline: order, disabling, and end-to-end numerics on a two-layer Llama-like program."""
import pytest
import torch
from kiln.compiler import PassContext, PassError, PassManager, parse_program, print_program
from kiln.passes import build_pipeline, kernel_selection
from pass_testlib import logits_before_after, tiny_llama_ir, typed

CPU = ["shape_inference", "quantize_weights", "fuse_qkv", "fuse_gate_up", "fuse_expert_gate_up", "fuse_silu_mul",
       "fuse_add_rms_norm", "mla_absorption", "fuse_dequant_linear", "quantize_kv_cache", "fuse_rope_kv_write", "place_parallel",
       "fuse_all_reduce_add_rms_norm", "vocab_parallel_sampling", "dead_code_elimination",
       "kernel_selection"]


def test_cpu_pipeline_order():
    assert [p.name for p in build_pipeline("cpu")] == CPU
    assert PassManager.for_target("cpu").names == CPU


def test_disabled_passes_are_left_out():
    names = [p.name for p in build_pipeline("cpu", disable=["fuse_qkv", "fuse_silu_mul"])]
    assert names == [n for n in CPU if n not in ("fuse_qkv", "fuse_silu_mul")]


def test_unknown_target_or_pass_is_an_error():
    from kiln.compiler.targets import TargetError

    with pytest.raises(TargetError, match="unknown target 'tpu'"):
        build_pipeline("tpu")
    with pytest.raises(PassError, match="no pass named 'fuse_qvk'"):
        build_pipeline("cpu", disable=["fuse_qvk"])


# ---------------------------------------------------------------- declared ordering constraints (issue 18)

@pytest.mark.parametrize("edit, message", [
    # fuse_silu_mul matches the slices fuse_gate_up leaves
    (lambda pm: pm.insert_before("fuse_gate_up", _pass("fuse_silu_mul")),
     "pass 'fuse_silu_mul' must run after 'fuse_gate_up' .declared by 'fuse_silu_mul'., but 'fuse_gate_up' comes after it"),
    # quantized siblings are merged by the fusions
    (lambda pm: pm.insert_after("fuse_qkv", _pass("quantize_weights")),
     "pass 'quantize_weights' must run before 'fuse_qkv' .declared by 'quantize_weights'., but 'fuse_qkv' comes before it"),
    (lambda pm: pm.insert_before("fuse_qkv", _pass("quantize_kv_cache")),
     "pass 'quantize_kv_cache' must run after 'fuse_qkv'"),
    (lambda pm: pm.insert_before("quantize_kv_cache", _pass("fuse_rope_kv_write")),
     "pass 'fuse_rope_kv_write' must run after 'quantize_kv_cache'"),
    (lambda pm: pm.insert_after("kernel_selection", _pass("fuse_qkv")), "pass 'fuse_qkv' must run before 'kernel_selection'"),
    (lambda pm: pm.remove("shape_inference"), "cannot disable 'shape_inference': 'quantize_weights', 'fuse_qkv', .* require it"),
    (lambda pm: pm.insert_before("shape_inference", _pass("fuse_qkv")),
     "pass 'fuse_qkv' requires 'shape_inference' to run before it"),
])
def test_editing_the_pipeline_against_a_declared_constraint_is_refused(edit, message):
    """The orderings the pipeline's comments explain are declared by the passes (after=/before=/requires=): an
    edit that breaks one is refused with the passes' names, and the pipeline is left as it was."""
    pm = PassManager.for_target("cpu")
    with pytest.raises(PassError, match=message):
        edit(pm)
    assert pm.names == CPU


def test_a_constraint_of_an_absent_pass_does_not_bind():
    """after=/before= order passes that are both present: disabling fuse_gate_up leaves fuse_silu_mul free."""
    pm = PassManager.for_target("cpu")
    pm.remove("fuse_gate_up")
    pm.remove("fuse_silu_mul")
    pm.insert_after("shape_inference", _pass("fuse_silu_mul"))
    assert pm.names[:2] == ["shape_inference", "fuse_silu_mul"]


def test_shape_inference_types_the_ir_by_a_declared_property():
    """The verifier requires types after a pass that guarantees "typed", whatever its name."""
    from kiln.compiler import Pass, register_pass
    from kiln.passes.shape_inference import ShapeInference

    @register_pass("my_typer", guarantees=("typed",))
    class MyTyper(Pass):
        def run(self, program, ctx):
            return ShapeInference().run(program, ctx)

    @register_pass("untype_one_node")
    class Untype(Pass):
        def run(self, program, ctx):
            g = program.graphs["decoder"].copy()
            vid = next(v for v, n in g.items() if n.op == "silu")
            g.replace(vid, g.node(vid).with_(out=None))
            return program.with_graphs({"decoder": g})

    with pytest.raises(PassError, match="IR is invalid after pass 'untype_one_node'"):
        PassManager([MyTyper(), Untype()]).run(parse_program(tiny_llama_ir(False)), PassContext())
    PassManager([Untype()]).run(parse_program(tiny_llama_ir(False)), PassContext())  # untyped IR is fine before typing


def _pass(name: str):
    from kiln.compiler.pass_manager import registered_passes

    return registered_passes()[name]()


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
        "fuse_dequant_linear": 0, "fuse_rope_kv_write": 1, "fuse_all_reduce_add_rms_norm": 0}  # single device

    # the dump after the last pass reads back as the same program
    last = max(tmp_path.glob("*.ir"))
    assert last.name == f"{len(CPU):02d}_kernel_selection.ir"
    assert print_program(parse_program(last.read_text())) == print_program(after)
