"""Fuses silu(first half) * second half of one value into a single `silu_mul`."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, TensorType, register_pass
from kiln.compiler.rewrite import Match, P, Rewrite, V, apply_rewrites


def _halves_of_y(m: Match) -> bool:
    """The gate slice is exactly y[..., :F] and the up slice exactly y[..., F:2F], y's whole last dim."""
    y = m.graph.node(m["y"]).out
    gate, up = m.node("gate").attrs, m.node("up").attrs
    if not isinstance(y, TensorType) or not y.shape or not isinstance(y.shape[-1], int):
        return False
    f = gate["stop"]
    return gate["start"] == 0 and up["start"] == f and up["stop"] == 2 * f == y.shape[-1]


REWRITES = (
    # mul(silu(slice(y, 0, F)), slice(y, F, 2F)) -> silu_mul(y)
    Rewrite("silu_mul",
            P("mul", P("silu", P("slice", V("y"), name="gate")), P("slice", V("y"), name="up"), commutative=True),
            replace=lambda m, b: b.add("silu_mul", (m["y"],), hint=m.root),
            extra_check=_halves_of_y),
)


# after fuse_gate_up: silu_mul matches the slices of the merged gate/up GEMM it leaves
@register_pass("fuse_silu_mul", requires=("shape_inference",), after=("fuse_gate_up",), before=("kernel_selection",))
class FuseSiLUMul(Pass):
    """Requires: typed IR. Guarantees: no `mul(silu(y[..., :F]), y[..., F:2F])` remains where y's last dim
    is 2F; each became `silu_mul(y)` (slices still read elsewhere are kept)."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
