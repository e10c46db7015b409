"""kernel_selection: every node gets the target's kernel id for its op."""
import pytest
import torch
from kiln.compiler import PassContext
from kiln.compiler.ops import OPS
from kiln.passes import kernel_selection
from kiln.passes.kernel_selection import KernelSelection, KernelSelectionError
from pass_testlib import (
    assert_programs_equal,
    logits_before_after,
    run_pass,
    run_pass_on_text,
    tiny_llama_ir,
    typed,
)

BEFORE = """
program p dtype=f32 {
  config {}
  param w: f32[16, 8] from ["w"]
  param g: f32[8] from ["g"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %r = input "r" : f32[T, 8]
    %g = param "g" : f32[8]
    %t = add_rms_norm(%x, %r, %g)
    %n = getitem(%t) {index=0}
    %w = param "w" : f32[16, 8]
    %y = linear(%n, %w)
    %m = silu_mul(%y)
    return %m
  }
}
"""

EXPECTED = """
program p dtype=f32 {
  config {}
  param w: f32[16, 8] from ["w"]
  param g: f32[8] from ["g"]
  graph entry {
    %x = input "x" {kernel="inline"} : f32[T, 8]
    %r = input "r" {kernel="inline"} : f32[T, 8]
    %g = param "g" {kernel="inline"} : f32[8]
    %t = add_rms_norm(%x, %r, %g) {kernel="tvm.add_rms_norm"}
    %n = getitem(%t) {index=0, kernel="inline"}
    %w = param "w" {kernel="inline"} : f32[16, 8]
    %y = linear(%n, %w) {kernel="tvm.linear"}
    %m = silu_mul(%y) {kernel="tvm.silu_mul"}
    return %m
  }
}
"""


def test_sets_cpu_kernel_ids():
    out, ctx = run_pass(KernelSelection("cpu"), typed(BEFORE))
    assert_programs_equal(out, typed(EXPECTED))
    assert ctx.stats["kernels"] == {"tvm.add_rms_norm": 1, "tvm.linear": 1, "tvm.silu_mul": 1, "inline": 5}


def test_already_selected_returns_the_same_program():
    before = typed(EXPECTED)
    out, _ = run_pass(KernelSelection(), before)  # target from ctx.target ("cpu")
    assert out is before


def test_every_op_has_a_cpu_kernel():
    assert set(OPS) <= set(kernel_selection.kernel_table("cpu")), "a new op needs a cpu kernel id"


def test_target_without_kernels_is_a_clear_error():
    with pytest.raises(KernelSelectionError, match="target 'tpu' has no kernels yet"):
        KernelSelection("tpu").run(typed(BEFORE), PassContext())


def test_op_without_a_kernel_on_the_target_is_a_clear_error(monkeypatch):
    table = {k: v for k, v in kernel_selection.kernel_table("cpu").items() if k != "silu_mul"}
    monkeypatch.setitem(kernel_selection.KERNEL_TABLES, "toy", table)
    with pytest.raises(KernelSelectionError, match=r"%m = silu_mul: no 'toy' kernel for op 'silu_mul'"):
        KernelSelection("toy").run(typed(BEFORE), PassContext())


def test_interpreter_ignores_the_kernel_attribute():
    before, after, _ = run_pass_on_text(KernelSelection("cpu"), tiny_llama_ir())
    ref, got = logits_before_after(before, after)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


ATTENTION = """
program p dtype={dtype} {{
  config {{}}
  param ks: f32[2] from ["ks"]
  graph entry {{
    %q = input "q" : {dtype}[T, 4, 16]
    %k = input "k" : {dtype}[T, 2, 16]
    %v = input "v" : {dtype}[T, 2, 16]
    %ks = param "ks" : f32[2]
    %a = attention(%q, %k, %v{scales}){attrs}
    return %a
  }}
}}
"""


@pytest.mark.parametrize("dtype,fp8,kernel", [
    ("f32", False, "tvm.paged_attention"),
    ("bf16", False, "tvm.paged_attention"),
    ("f16", False, "cpu.paged_attention"),  # no f16 TVM kernel: the torch one
    ("f32", True, "cpu.paged_attention"),  # an fp8 KV cache stays on torch
])
def test_cpu_attention_choice_follows_dtype_and_kv_cache(dtype, fp8, kernel):
    """The cpu table's first choice for attention is the TVM kernel, where its condition holds."""
    scales = ", %ks, %ks" if fp8 else ""
    before = ATTENTION.format(dtype=dtype, scales=scales, attrs=' {kv_dtype="fp8e4m3"}' if fp8 else "")
    expected = ATTENTION.format(dtype=dtype, scales=scales, attrs=" {" + ('kernel="%s", kv_dtype="fp8e4m3"' if fp8
                                                                          else 'kernel="%s"') % kernel + "}")
    expected = expected.replace('" : ', '" {kernel="inline"} : ')
    out, ctx = run_pass(KernelSelection("cpu"), typed(before))
    assert_programs_equal(out, typed(expected))
    assert ctx.stats["kernels"][kernel] == 1


GEMMS = """
program p dtype={dtype} {{
  config {{}}
  param w: {dtype}[8, 8] from ["w"]
  param e: {dtype}[32, 8] from ["e"]
  graph entry {{
    %x = input "x" : {dtype}[T, 8]
    %w = param "w" : {dtype}[8, 8]
    %e = param "e" : {dtype}[32, 8]
    %y = linear(%x, %w)
    %l = logits(%y, %e)
    return %l
  }}
}}
"""


@pytest.mark.parametrize("dtype,linear,logits", [
    ("f32", "tvm.linear", "tvm.logits"),
    ("bf16", "tvm.linear", "tvm.logits"),
    ("f16", "cpu.linear", "cpu.logits"),  # no f16 TVM GEMM: torch's
])
def test_cpu_gemm_choice_follows_dtype(dtype, linear, logits):
    """linear (by its output dtype) and the LM head (fp32 out: by its inputs' dtype) go to the TVM GEMM."""
    out, ctx = run_pass(KernelSelection("cpu"), typed(GEMMS.format(dtype=dtype)))
    kernels = {n.op: n.attrs["kernel"] for _, n in out.graphs["entry"].items()}
    assert (kernels["linear"], kernels["logits"]) == (linear, logits)


def test_gpu_tables_keep_their_own_attention_kernel():
    assert kernel_selection.kernel_table("h200")["attention"] == "triton.paged_attention"
    assert kernel_selection.kernel_table("h200")["rms_norm"] == "triton.rms_norm"
