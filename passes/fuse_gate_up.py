"""Merges the gate and up projections of a gated MLP into one linear over a fused `wgate_up` param."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import P, Pat, Rewrite, V, apply_rewrites
from kiln.passes.linear_fusion import (
    QUANT_WEIGHT_OPS,
    fuse_linears,
    fuse_quantized_linears,
    fusible_linears,
    fusible_quantized,
    quantized_projection,
)

ROLES = ("gate", "up")


def _gated_mlp(bias: bool) -> Pat:
    def proj(role: str) -> Pat:
        ins = (V("x"), P("param", name=f"w{role}")) + ((P("param", name=f"b{role}"),) if bias else ())
        return P("linear", *ins, name=role)

    return P("mul", P("silu", proj("gate")), proj("up"), commutative=True)


def _quantized(op: str, bias: bool) -> Rewrite:
    pattern = P("mul", P("silu", quantized_projection(op, "gate", bias)), quantized_projection(op, "up", bias),
                commutative=True)
    return Rewrite(f"gate_up_{op}" + ("_bias" if bias else ""), pattern,
                   replace=lambda m, b: fuse_quantized_linears(m, b, op, ROLES, bias, fused="gate_up"),
                   extra_check=lambda m: fusible_quantized(m, op, ROLES, bias))


REWRITES = (
    # mul(silu(linear(x, w_gate)), linear(x, w_up))
    #   -> y = linear(x, wgate_up); mul(silu(slice(y, 0, F)), slice(y, F, 2F))
    Rewrite("gate_up", _gated_mlp(bias=False),
            replace=lambda m, b: fuse_linears(m, b, ROLES, bias=False, fused="gate_up"),
            extra_check=lambda m: fusible_linears(m, ROLES, bias=False)),
    # the same with biases -> bgate_up
    Rewrite("gate_up_bias", _gated_mlp(bias=True),
            replace=lambda m, b: fuse_linears(m, b, ROLES, bias=True, fused="gate_up"),
            extra_check=lambda m: fusible_linears(m, ROLES, bias=True)),
    # the same over quantized weights (fp8; int4 AWQ):
    # mul(silu(linear(x, dequant(w_gate_*))), linear(x, dequant(w_up_*))) -> y = linear(x, dequant(wgate_up_*)); ...
    *(_quantized(op, bias) for op in QUANT_WEIGHT_OPS for bias in (False, True)),
)


@register_pass("fuse_gate_up", requires=("shape_inference",), before=("kernel_selection",))
class FuseGateUp(Pass):
    """Requires: typed IR. Guarantees: every `silu(gate) * up` whose gate and up are projections of one
    input by plain `param` weights (both with bias or neither) reads them from a single linear over
    `{block}.wgate_up` (`source` = gate's sources then up's, along dim 0; bias `{block}.bgate_up`), as the
    slices [0:F] and [F:F+F_up]. The replaced params are dropped once no graph reads them. Quantized gate
    and up (fp8; int4 AWQ, not GPTQ) merge the same way into `{block}.wgate_up_<role>` params where the
    concatenation is exact (see linear_fusion)."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
