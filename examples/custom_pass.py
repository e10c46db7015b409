"""A custom kiln pass, written against the public pass API.

`GemmShapes` is an analysis pass: it records every GEMM the model will run per step — (out_features,
in_features, calls per step) — into the pass log, which is what you need to pick or tune GEMM kernels.
It changes nothing, so it returns the very same Program object (the log then says `unchanged`).

Use it from Python:

    from kiln.compiler import PassManager
    pm = PassManager.for_target("cpu")
    pm.insert_after("fuse_gate_up", GemmShapes())

or from a recipe (the module must be importable, e.g. on PYTHONPATH):

    passes { after fuse_gate_up: "custom_pass:GemmShapes" }
"""
from __future__ import annotations

from collections import Counter

from kiln.compiler import Pass, PassContext, Program, register_pass


@register_pass("gemm_shapes", requires=("shape_inference",))
class GemmShapes(Pass):
    """Requires: typed IR. Guarantees: the program is unchanged; ctx.stats["gemms"] lists
    [out_features, in_features, calls per step] for every distinct linear weight shape."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        per_graph = {"entry": 1, **{b.graph: b.count for b in program.blocks.values()}}
        gemms: Counter[tuple[int, int]] = Counter()
        for name, graph in program.graphs.items():
            for _, node in graph.items():
                if node.op in ("linear", "logits"):
                    w = graph.node(node.inputs[1]).out
                    gemms[(int(w.shape[0]), int(w.shape[1]))] += per_graph[name]
        ctx.stats["gemms"] = sorted([n, k, c] for (n, k), c in gemms.items())
        return program
