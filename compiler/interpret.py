"""Reference interpreter: runs a Program on one dense sequence with the op table's torch references.

It defines what a Program *means*. Pass numerics tests run it before and after a pass; kernel and
artifact tests compare against it; it is slow and simple on purpose.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from kiln.compiler.ir import Graph, Program, at_layer
from kiln.compiler.ops import OPS, REQUIRED, RefContext


def reference_attrs(op: str, attrs: Mapping[str, Any], layer: int | None = None) -> dict[str, Any]:
    """The attributes an op's reference takes at block layer `layer`: declared ones, per-layer values
    resolved, defaults filled, annotations dropped."""
    out = {}
    for key, default in OPS[op].attrs.items():
        if key in attrs:
            value = at_layer(attrs[key], layer)
            out[key] = list(value) if isinstance(value, tuple) else value
        elif default is not REQUIRED:
            out[key] = default
    return out


# observe(graph, value id, node, layer, input values) is called before each compute node runs (calibration).
Observer = Callable[[Graph, str, Any, int | None, tuple[Any, ...]], None]


def run_graph(program: Program, graph: Graph, args: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
              ctx: RefContext, layer: int | None = None, observe: Observer | None = None) -> list[Any]:
    env: dict[str, Any] = {}
    for vid, node in graph.items():
        if node.op == "input":
            env[vid] = args[node.attrs["name"]]
        elif node.op == "param":
            env[vid] = weights[program.params[node.attrs["name"]].layer_name(layer)]
        elif node.op == "block":
            spec = program.blocks[node.attrs["block"]]
            block_graph = program.graphs[spec.graph]
            (arg_name,) = [block_graph.node(i).attrs["name"] for i in block_graph.inputs]
            h = env[node.inputs[0]]
            for i in range(spec.count):
                (h,) = run_graph(program, block_graph, {arg_name: h}, weights, ctx, layer=i, observe=observe)
            env[vid] = h
        else:
            ref = OPS[node.op].reference
            assert ref is not None, f"op {node.op!r} has no reference implementation"
            if observe is not None:
                observe(graph, vid, node, layer, tuple(env[i] for i in node.inputs))
            env[vid] = ref(ctx, *(env[i] for i in node.inputs), **reference_attrs(node.op, node.attrs, layer))
    return [env[o] for o in graph.outputs]


@torch.no_grad()
def interpret(program: Program, weights: Mapping[str, torch.Tensor], tokens: torch.Tensor,
              observe: Observer | None = None) -> torch.Tensor:
    """fp32 logits [T, vocab] of a single sequence `tokens` (prefill from position 0)."""
    ctx = RefContext(positions=torch.arange(tokens.shape[0]))
    # the entry may also return hidden states for a draft head after its logits
    logits, *_ = run_graph(program, program.entry, {program.entry.node(program.entry.inputs[0]).attrs["name"]: tokens},
                           weights, ctx, observe=observe)
    return logits
