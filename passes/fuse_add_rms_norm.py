"""Fuses a residual add and the rms_norm that reads it into one `add_rms_norm`."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.ops import OPS
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites


def _residual_used_elsewhere(m: Match) -> bool:
    return len(m.users("s")) > 1 or m.is_output("s")


def _add_rms_norm(m: Match, b: Builder) -> dict[str, str]:
    eps = m.node("x").attrs.get("eps", OPS["rms_norm"].attrs["eps"])
    t = b.add("add_rms_norm", (m["a"], m["b"], m["w"]), hint=f"{m['s']}_{m['x']}", eps=eps)
    return {"x": b.add("getitem", (t,), hint=m["x"], index=0), "s": b.add("getitem", (t,), hint=m["s"], index=1)}


REWRITES = (
    # s = add(a, b); x = rms_norm(s, w); s read elsewhere
    #   -> t = add_rms_norm(a, b, w); x = getitem(t, 0); s = getitem(t, 1)
    Rewrite("add_rms_norm", P("rms_norm", P("add", V("a"), V("b"), name="s"), V("w"), name="x"),
            replace=_add_rms_norm, extra_check=_residual_used_elsewhere),
)


@register_pass("fuse_add_rms_norm", requires=("shape_inference",), before=("kernel_selection",))
class FuseAddRMSNorm(Pass):
    """Requires: typed IR. Guarantees: every `rms_norm(add(a, b), w)` whose sum is also read elsewhere (the
    residual stream) is one `add_rms_norm(a, b, w)`; its element 0 replaces the norm, element 1 the sum."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
