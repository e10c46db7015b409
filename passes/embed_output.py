"""`task = embed`: the model returns the final-normed hidden states of the rows the runtime asks for, not logits."""
from __future__ import annotations

from kiln.compiler import Node, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.ir import TensorType


@register_pass("embed_output", requires=("shape_inference",),
               before=("dead_code_elimination", "kernel_selection", "cuda_graph_plan"))
class EmbedOutput(Pass):
    """Requires: typed IR whose entry graph returns `logits(x, w)` first. Guarantees: the entry returns only
    `hidden_rows(x)` (x: the hidden states the LM head would read, after the final norm), fp32 [rows, hidden]
    at batch.logits_indices; the LM head weight and any draft-head outputs are left for dead-code elimination.
    The runtime (an embedding artifact, manifest `task`) pools these rows per request."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        entry = program.entry
        node = entry.node(entry.outputs[0])
        if node.op != "logits":
            raise PassError(f"task = embed needs a model whose forward returns logits(...) first, not {node.op}")
        x = entry.node(node.inputs[0]).out
        assert isinstance(x, TensorType), "embed_output runs on typed IR"
        g = entry.copy()
        vid = g.add(g.fresh("hidden_rows"), Node("hidden_rows", (node.inputs[0],), out=TensorType(
            (x.shape[0], x.shape[-1]), "f32"), loc=node.loc))
        g.outputs = (vid,)
        ctx.stats["hidden"] = x.shape[-1]
        return program.with_graphs({"entry": g})
