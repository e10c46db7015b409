"""Fuses each weight dequantization into the GEMM that reads it: linear(x, dequant(...)) -> linear_fp8/linear_w4a16."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites

_FUSED = {"dequant_fp8": "linear_fp8", "dequant_int4": "linear_w4a16"}


def _fuse(m: Match, b: Builder) -> str:
    dq = m.node("dq")
    attrs = {k: v for k, v in dq.attrs.items() if k not in ("dtype", "kernel")}
    bias = (m["b"],) if "b" in m.bindings else ()
    return b.add(_FUSED[dq.op], (m["x"], *dq.inputs, *bias), hint=m.root, **attrs)


def _same_dtype(m: Match) -> bool:
    """The dequantized weight is in the activation dtype (the fused kernel dequantizes to x's dtype)."""
    return m.node("dq").attrs["dtype"] == m.graph.node(m["x"]).out.dtype


REWRITES = (
    # linear(x, dequant_fp8(w, s)) -> linear_fp8(x, w, s)
    Rewrite("fp8", P("linear", V("x"), P("dequant_fp8", name="dq")), replace=_fuse, extra_check=_same_dtype),
    # linear(x, dequant_fp8(w, s), b) -> linear_fp8(x, w, s, b)
    Rewrite("fp8_bias", P("linear", V("x"), P("dequant_fp8", name="dq"), V("b")), replace=_fuse,
            extra_check=_same_dtype),
    # linear(x, dequant_int4(qweight, qzeros, scales[, g_idx])) -> linear_w4a16(x, qweight, qzeros, scales[, g_idx])
    Rewrite("int4", P("linear", V("x"), P("dequant_int4", name="dq")), replace=_fuse, extra_check=_same_dtype),
    # the same with a bias, last
    Rewrite("int4_bias", P("linear", V("x"), P("dequant_int4", name="dq"), V("b")), replace=_fuse,
            extra_check=_same_dtype),
)


# after the fusions that merge quantized siblings (fuse_qkv, fuse_gate_up): one GEMM per merged weight
@register_pass("fuse_dequant_linear", requires=("shape_inference",), after=("fuse_qkv", "fuse_gate_up"),
               before=("kernel_selection",))
class FuseDequantLinear(Pass):
    """Requires: typed IR. Guarantees: no `linear` reads a `dequant_fp8`/`dequant_int4` of its activation
    dtype: each is one `linear_fp8(x, w, scale[, b])` / `linear_w4a16(x, <packed params>[, b])` with the
    dequant's attributes, so the GEMM kernel reads the quantized weight itself (a GPU kernel dequantizes tiles
    in registers; the CPU kernel dequantizes once and caches). Dequants left without readers are removed."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
