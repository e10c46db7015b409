"""Removes nodes no graph output depends on, and params no graph reads."""
from __future__ import annotations

import networkx as nx
from kiln.compiler import Graph, Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import params_read


def _live(graph: Graph) -> set[str]:
    live = set(graph.outputs) | set(graph.inputs)  # inputs are the graph's calling convention: kept
    for out in graph.outputs:
        live |= nx.ancestors(graph.g, out)
    return live


@register_pass("dead_code_elimination", before=("kernel_selection",))
class DeadCodeElimination(Pass):
    """Requires: nothing. Guarantees: every node of every graph is a graph input or an ancestor of (or
    is) a graph output; every param in `program.params` is read by some graph's `param` node."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        graphs: dict[str, Graph] = {}
        removed = 0
        for name, graph in program.graphs.items():
            dead = set(graph.g) - _live(graph)
            if not dead:
                continue
            g = graph.copy()
            for vid in reversed(g.order()):  # users before producers; a dead node's users are all dead
                if vid in dead:
                    g.remove(vid)
            graphs[name] = g
            removed += len(dead)
        out = program.with_graphs(graphs) if graphs else program
        read = params_read(out.graphs)
        unread = [p for p in out.params if p not in read]
        if unread:
            out = out.with_params({k: v for k, v in out.params.items() if k in read})
        ctx.stats.update(nodes_removed=removed, params_removed=len(unread))
        return out
