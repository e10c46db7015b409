"""The one IR verifier, run after every pass: structure, op signatures, and (once inferred) types."""
from __future__ import annotations

import networkx as nx
from kiln.compiler.ir import Graph, Program, TupleType
from kiln.compiler.ops import OPS, REQUIRED, ShapeError
from kiln.compiler.placement import PlacementError, check_placements


class VerifyError(Exception):
    """The IR breaks an invariant; raised with the graph, value id and reason."""


def verify_graph(graph: Graph, program: Program | None = None, *, require_types: bool = False) -> None:
    where = f"graph {graph.name!r}"
    if not nx.is_directed_acyclic_graph(graph.g):
        raise VerifyError(f"{where}: has a cycle")
    for out in graph.outputs:
        if out not in graph:
            raise VerifyError(f"{where}: returns undefined value {out!r}")
    if not graph.outputs:
        raise VerifyError(f"{where}: returns nothing")
    for vid, node in graph.items():
        op = OPS.get(node.op)
        if op is None:
            raise VerifyError(f"{where}: %{vid} uses unknown op {node.op!r}")
        if not op.min_inputs <= len(node.inputs) <= op.max_inputs:
            raise VerifyError(f"{where}: %{vid} = {node.op} takes {op.min_inputs}..{op.max_inputs} inputs, "
                              f"got {len(node.inputs)}")
        for src in node.inputs:
            if src not in graph:
                raise VerifyError(f"{where}: %{vid} reads undefined %{src}")
        for key, default in op.attrs.items():
            if default is REQUIRED and key not in node.attrs:
                raise VerifyError(f"{where}: %{vid} = {node.op} lacks attribute {key!r}")
        if program is not None:
            if node.op == "param" and node.attrs["name"] not in program.params:
                raise VerifyError(f"{where}: %{vid} reads unknown param {node.attrs['name']!r}")
            if node.op == "block" and node.attrs["block"] not in program.blocks:
                raise VerifyError(f"{where}: %{vid} calls unknown block {node.attrs['block']!r}")
        for src in node.inputs:
            if node.op != "getitem" and isinstance(graph.node(src).out, TupleType):
                raise VerifyError(f"{where}: %{vid} reads tuple-valued %{src} directly; use getitem")
        if node.out is None:
            if require_types:
                raise VerifyError(f"{where}: %{vid} has no inferred type")
            continue
        in_types = [graph.node(s).out for s in node.inputs]
        if any(t is None for t in in_types):
            raise VerifyError(f"{where}: %{vid} has a type but one of its inputs does not")
        try:
            expected = op.infer(in_types, node.attrs)
        except ShapeError as e:
            raise VerifyError(f"{where}: %{vid} = {node.op}: {e}") from None
        if expected != node.out:
            raise VerifyError(f"{where}: %{vid} = {node.op} is typed {node.out} but its inputs give {expected}")


def verify_program(program: Program, *, require_types: bool = False) -> None:
    if "entry" not in program.graphs:
        raise VerifyError("program has no entry graph")
    for block in program.blocks.values():
        if block.graph not in program.graphs:
            raise VerifyError(f"block {block.name!r} names missing graph {block.graph!r}")
    for graph in program.graphs.values():
        verify_graph(graph, program, require_types=require_types)
    _verify_layer_schedule(program)
    for name, spec in program.params.items():
        if name != spec.name:
            raise VerifyError(f"param table key {name!r} holds spec {spec.name!r}")
        if spec.block is not None and spec.block not in program.blocks:
            raise VerifyError(f"param {name!r} belongs to unknown block {spec.block!r}")
    if require_types:
        for g in program.graphs.values():
            for vid, node in g.items():
                if node.op == "param":
                    spec = program.params[node.attrs["name"]]
                    if tuple(node.out.shape) != tuple(spec.shape):
                        raise VerifyError(f"graph {g.name!r}: %{vid} types param {spec.name!r} as {node.out}, "
                                          f"but the param is {list(spec.shape)}")
        try:  # a parallel program: every value placed as its op's rule gives; no partial reaches a non-reduction
            check_placements(program)
        except PlacementError as e:
            raise VerifyError(str(e)) from None


def _verify_layer_schedule(program: Program) -> None:
    """Each block is called once, from a forward graph (the entry, then the named forwards), and its first_layer
    is where its layers start in the layer schedule: param sources use that global layer index (`{i}`)."""
    forwards = program.forward_graphs()
    for name, graph in program.graphs.items():
        if name not in forwards and graph.count("block"):
            raise VerifyError(f"graph {name!r} calls a block; blocks are called only from forward graphs")
    next_layer = 0
    called: set[str] = set()
    for name in forwards:
        for vid, node in program.graphs[name].items():
            if node.op != "block" or node.attrs.get("block") not in program.blocks:
                continue
            block = program.blocks[node.attrs["block"]]
            if block.name in called:
                raise VerifyError(f"{name}: %{vid} calls block {block.name!r} a second time; a block runs once")
            called.add(block.name)
            if block.first_layer != next_layer:
                raise VerifyError(f"block {block.name!r} has first_layer={block.first_layer}, but its layers start "
                                  f"at {next_layer} in the layer schedule")
            next_layer += block.count
