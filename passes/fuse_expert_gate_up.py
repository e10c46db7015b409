"""Merges the stacked gate and up projections of routed experts into one fused `[E, 2F, H]` param."""
from __future__ import annotations

import dataclasses

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, V, apply_rewrites
from kiln.passes.linear_fusion import concatenable


def _stackable(m: Match) -> bool:
    gate, up = m.param("wgate"), m.param("wup")
    return (gate.name != up.name and gate.shape == up.shape and all(len(s.source) <= 1 for s in (gate, up))
            and concatenable([gate, up]))


def _fuse(m: Match, b: Builder) -> str:
    gate, up = m.param("wgate"), m.param("wup")
    experts, ffn, hidden = gate.shape
    name = f"{gate.block}.wgate_up" if gate.block else "wgate_up"
    # per expert, gate rows then up rows: the sources stack over {e} first, then concatenate along dim 1
    spec = dataclasses.replace(gate, name=name, shape=(experts, 2 * ffn, hidden), source=gate.source + up.source,
                               concat_dim=1)
    fused = b.add_param(spec, after=gate.name)
    return b.add("moe_experts", (m["x"], m["weights"], m["ids"], fused, m["wdown"]), hint=m.root)


REWRITES = (
    # moe_experts(x, weights, ids, w_gate, w_up, w_down) -> moe_experts(x, weights, ids, wgate_up, w_down)
    Rewrite("expert_gate_up",
            P("moe_experts", V("x"), V("weights"), V("ids"), P("param", name="wgate"), P("param", name="wup"),
              V("wdown")),
            replace=_fuse, extra_check=_stackable),
)


@register_pass("fuse_expert_gate_up", requires=("shape_inference",), before=("kernel_selection",))
class FuseExpertGateUp(Pass):
    """Requires: typed IR. Guarantees: every `moe_experts` whose gate and up stacks are plain, same-shape,
    unquantized, unsharded `param`s reads one `{block}.wgate_up` [E, 2F, H] instead (`source` = gate's then up's,
    `concat_dim` 1: expert e's rows are its gate rows then its up rows), so each expert runs one GEMM for both.
    The replaced params are dropped once no graph reads them."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)


__all__ = ["FuseExpertGateUp"]
