"""Fuses the all-reduce of a row-parallel GEMM with the residual add and RMSNorm that follow it."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites


def _reduced_once(m: Match) -> bool:
    return len(m.users("r")) == 1 and not m.is_output("r")


def _fuse(m: Match, b: Builder) -> str:
    norm = m.node("t")
    t = b.add("all_reduce_add_rms_norm", (m["x"], m["res"], m["w"]), hint=m["t"], eps=norm.attrs["eps"],
              placement=norm.attrs["placement"])
    return t


REWRITES = (
    # r = all_reduce(x); t = add_rms_norm(r, res, w) -> t = all_reduce_add_rms_norm(x, res, w)
    Rewrite("all_reduce_add_rms_norm",
            P("add_rms_norm", P("all_reduce", V("x"), name="r"), V("res"), V("w"), name="t"),
            replace=_fuse, extra_check=_reduced_once),
    # r = all_reduce(x); t = add_rms_norm(res, r, w) -> t = all_reduce_add_rms_norm(x, res, w)  (addition commutes)
    Rewrite("all_reduce_add_rms_norm",
            P("add_rms_norm", V("res"), P("all_reduce", V("x"), name="r"), V("w"), name="t"),
            replace=_fuse, extra_check=_reduced_once),
)


@register_pass("fuse_all_reduce_add_rms_norm", requires=("place_parallel",),
               before=("dead_code_elimination", "kernel_selection"))
class FuseAllReduceAddRMSNorm(Pass):
    """Requires: a placed program (place_parallel). Guarantees: every `add_rms_norm` whose one addend is an
    `all_reduce` read only by it reads the partial value itself, as one `all_reduce_add_rms_norm(x, residual, w)`
    (the reduction, the residual add and the norm in one kernel call); nothing changes on a single device."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
