"""Infers and checks the type of every value, graph by graph, block inputs from their call sites."""
from __future__ import annotations

from kiln.compiler import Graph, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.ops import OPS, ShapeError


class ShapeInferenceError(PassError):
    """A value's type does not follow from its inputs (a pass, or hand-written IR, broke the program)."""


def infer_graph(graph: Graph) -> tuple[Graph, bool]:
    """A copy of `graph` with every node's `out` re-derived from its inputs (input/param types are given)."""
    out = graph.copy()
    changed = False
    for vid in out.order():
        node = out.node(vid)
        try:
            t = OPS[node.op].infer([out.node(i).out for i in node.inputs], node.attrs)
        except ShapeError as e:
            where = f" (at {node.loc})" if node.loc else ""
            raise ShapeInferenceError(f"graph {graph.name!r}: %{vid} = {node.op}: {e}{where}") from None
        if t != node.out:
            out.replace(vid, node.with_(out=t))
            changed = True
    return out, changed


@register_pass("shape_inference", guarantees=("typed",))
class ShapeInference(Pass):
    """Requires: every `input`/`param` node carries its type. Guarantees: every node's `out` is its op's
    shape rule applied to its inputs (symbolic dims such as T kept); block graphs typed too."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        new = {}
        for name, graph in program.graphs.items():
            g, changed = infer_graph(graph)
            if changed:
                new[name] = g
        return program.with_graphs(new) if new else program
