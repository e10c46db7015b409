"""The dataflow IR: a Program of ParamSpecs and named Graphs (networkx DAGs of frozen Nodes)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from kiln.dsl.errors import Loc

Dim = int | str  # an int, or a symbol such as "T" (tokens in the step)
EXPERT_INDEX = "{e}"  # in a ParamSpec source: one checkpoint tensor per expert, stacked along dim 0


@dataclass(frozen=True, slots=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str  # f32 bf16 f16 i32 i64 fp8e4m3 ...

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self, symbols: Mapping[str, int] | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d if isinstance(d, int) else (symbols or {}).get(d, 1)
        return n


@dataclass(frozen=True, slots=True)
class TupleType:
    items: tuple[TensorType, ...]

    def __str__(self) -> str:
        return "(" + ", ".join(str(t) for t in self.items) + ")"


ValueType = TensorType | TupleType


@dataclass(frozen=True, slots=True)
class PerLayer:
    """An attribute value that differs by layer of a block: `values[i]` at the block's layer i (the DSL's
    `per_layer(mask, a, b)`). One block graph serves every layer; codegen indexes `values` by the layer, the
    interpreter resolves it per layer (`at_layer`). Gemma's sliding/global attention layers are one block."""

    values: tuple

    def __str__(self) -> str:
        return f"per_layer{list(self.values)}"


def at_layer(value: Any, layer: int | None) -> Any:
    """`value` at block layer `layer`: a PerLayer's entry, inside an Attrs too (an absorbed rope's attributes)."""
    if isinstance(value, PerLayer):
        assert layer is not None, f"{value} read outside a block layer"
        return value.values[layer]
    if isinstance(value, Attrs):
        return Attrs({k: at_layer(value[k], layer) for k in value})
    return value


def layer_values(value: Any) -> tuple:
    """Every value `value` takes over the layers: a PerLayer's distinct entries, else the value itself."""
    return tuple(dict.fromkeys(value.values)) if isinstance(value, PerLayer) else (value,)


class Attrs(Mapping[str, Any]):
    """An immutable, hashable, ordered-by-key mapping of node attributes."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()):
        d = dict(items)
        self._items = tuple(sorted((k, _freeze(v)) for k, v in d.items()))
        self._hash = hash(self._items)

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Attrs):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Attrs({dict(self._items)!r})"

    def replace(self, **changes: Any) -> Attrs:
        d = dict(self._items)
        d.update(changes)
        return Attrs(d)


def _freeze(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return Attrs(v)
    return v


@dataclass(frozen=True, slots=True)
class Node:
    """One operation. Its value id is its key in the Graph; `inputs` are value ids of other nodes."""

    op: str
    inputs: tuple[str, ...] = ()
    attrs: Attrs = field(default_factory=Attrs)
    out: ValueType | None = None  # filled in by shape inference
    loc: Loc | None = field(default=None, compare=False)

    def with_(self, **changes: Any) -> Node:
        if "attrs" in changes and not isinstance(changes["attrs"], Attrs):
            changes["attrs"] = Attrs(changes["attrs"])
        return dataclasses.replace(self, **changes)


class Graph:
    """A dataflow DAG of Nodes on a networkx.DiGraph.

    Node keys are value ids; an edge u→v with attribute `index` says v reads u as its index-th input.
    `inputs` are the ids of the graph's `input` nodes in call order; `outputs` the returned ids.
    Iteration order is a deterministic topological order (ties broken by insertion order), so printing
    and code generation are reproducible.
    """

    def __init__(self, name: str):
        self.name = name
        self.g = nx.DiGraph()
        self.inputs: tuple[str, ...] = ()
        self.outputs: tuple[str, ...] = ()
        self._order = 0

    # ------------------------------------------------------------ construction
    def add(self, vid: str, node: Node) -> str:
        assert vid not in self.g, f"value id {vid!r} already defined in graph {self.name!r}"
        for src in node.inputs:
            assert src in self.g, f"{vid} = {node.op}(...) reads undefined value {src!r}"
        self.g.add_node(vid, node=node, order=self._order)
        self._order += 1
        for i, src in enumerate(node.inputs):
            self._add_edge(src, vid, i)
        if node.op == "input":
            self.inputs = (*self.inputs, vid)
        return vid

    def _add_edge(self, src: str, dst: str, index: int) -> None:
        if self.g.has_edge(src, dst):
            self.g.edges[src, dst]["index"] = (*self.g.edges[src, dst]["index"], index)
        else:
            self.g.add_edge(src, dst, index=(index,))

    def fresh(self, hint: str) -> str:
        """A value id not yet used in this graph, derived from `hint`."""
        if hint not in self.g:
            return hint
        n = 1
        while f"{hint}_{n}" in self.g:
            n += 1
        return f"{hint}_{n}"

    def replace(self, vid: str, node: Node) -> None:
        """Swaps the node stored at `vid` (same value id), rewiring its input edges."""
        for src in list(self.g.predecessors(vid)):
            self.g.remove_edge(src, vid)
        for src in node.inputs:
            assert src in self.g, f"{vid} = {node.op}(...) reads undefined value {src!r}"
        self.g.nodes[vid]["node"] = node
        for i, src in enumerate(node.inputs):
            self._add_edge(src, vid, i)

    def replace_all_uses(self, old: str, new: str) -> None:
        """Every reader of `old` (and the graph outputs) reads `new` instead."""
        for user in list(self.g.successors(old)):
            if user == new:
                continue
            n = self.node(user)
            self.replace(user, n.with_(inputs=tuple(new if i == old else i for i in n.inputs)))
        self.outputs = tuple(new if o == old else o for o in self.outputs)

    def remove(self, vid: str) -> None:
        assert not list(self.g.successors(vid)), f"cannot remove {vid!r}: still read by {self.users(vid)}"
        assert vid not in self.outputs, f"cannot remove {vid!r}: it is a graph output"
        self.g.remove_node(vid)
        self.inputs = tuple(i for i in self.inputs if i != vid)

    def copy(self) -> Graph:
        other = Graph(self.name)
        other.g = self.g.copy()
        other.inputs, other.outputs, other._order = self.inputs, self.outputs, self._order
        return other

    # ------------------------------------------------------------ queries
    def node(self, vid: str) -> Node:
        return self.g.nodes[vid]["node"]

    def __contains__(self, vid: str) -> bool:
        return vid in self.g

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def users(self, vid: str) -> list[str]:
        return sorted(self.g.successors(vid), key=lambda u: self.g.nodes[u]["order"])

    def order(self) -> list[str]:
        """Value ids in deterministic topological order."""
        return list(nx.lexicographical_topological_sort(self.g, key=lambda v: self.g.nodes[v]["order"]))

    def items(self) -> Iterator[tuple[str, Node]]:
        for vid in self.order():
            yield vid, self.node(vid)

    def ops(self) -> list[str]:
        return [n.op for _, n in self.items()]

    def count(self, op: str) -> int:
        # order-independent: no topological sort
        return sum(1 for _, n in self.g.nodes(data="node") if n.op == op)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A weight the artifact carries.

    `name` is "embed" for a top-level param or "decoder.wq" for a block param (instantiated per layer as
    "decoder.{i}.wq", i counting from 0 within the block). `source` lists checkpoint tensor name templates;
    several sources are concatenated along `concat_dim` at compile time (fused weights). `{i}` in a source is
    the *global* layer index, the layer's position in the model's layer schedule (`BlockSpec.first_layer` +
    the block-local index), because checkpoints number layers across the whole stack: the MoE block of a
    model with 3 dense layers first reads "model.layers.3..." for its layer 0.

    Expert stacks: a source naming `{e}` is one checkpoint tensor per expert, stacked along a new dim 0 over
    e in range(shape[0]) (`param w_gate: [experts, ffn, hidden] from "...experts.{e}.w1.weight"`). Stacking
    happens per source, before the concatenation, so a fused per-expert gate_up is the gate stack and the
    up stack concatenated along dim 1. A source without `{e}` on such a param is an already-stacked tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: tuple[str, ...] = ()
    block: str | None = None
    concat_dim: int = 0
    quant: Attrs | None = None
    sharding: Attrs | None = None
    loc: Loc | None = field(default=None, compare=False)
    fallback: tuple[str, ...] = ()  # sources read instead when the checkpoint lacks `source` (`from "a" else "b"`)
    offset: float = 0.0  # added to the checkpoint tensor at conversion (`from "a" + 1.0`: Gemma's 1 + w norms)
    transposed: bool = False  # the checkpoint tensors hold the last two dims swapped (`from "a" transposed`)

    @property
    def local_name(self) -> str:
        return self.name.split(".", 1)[1] if self.block else self.name

    def layer_name(self, i: int) -> str:
        """The name of layer i's tensor in the artifact's weights."""
        return f"{self.block}.{i}.{self.local_name}" if self.block else self.name

    def sources_for(self, i: int | None) -> tuple[str, ...]:
        """The checkpoint tensor names of global layer i (`BlockSpec.global_layer`); None for top-level params."""
        return tuple(s.replace("{i}", str(i)) for s in self.source) if i is not None else self.source

    @property
    def expert_stacked(self) -> bool:
        """Whether dim 0 is an expert stack: some source names the expert index `{e}`."""
        return any(EXPERT_INDEX in s for s in self.source)


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A repeated block: graph `graph` run `count` times with layer-indexed params.

    `first_layer` is the global index of the block's layer 0: the number of layers the blocks called before
    it run (instantiation computes it from the order of block calls; a block is called once). The verifier
    holds it to the layer schedule. Checkpoint sources use global indices, artifact tensor names local ones.
    """

    name: str
    graph: str
    count: int
    first_layer: int = 0

    def global_layer(self, i: int) -> int:
        """The model-wide index of this block's layer i (what `{i}` in a param source means)."""
        return self.first_layer + i


@dataclass(frozen=True)
class Program:
    """The whole model: config, params, the `entry` graph and one graph per block kind.

    Passes never mutate a Program; they return a new one (dataclasses.replace) or the same object.
    """

    name: str
    config: Mapping[str, Any]
    params: Mapping[str, ParamSpec]
    graphs: Mapping[str, Graph]
    blocks: Mapping[str, BlockSpec] = field(default_factory=dict)
    dtype: str = "f32"
    meta: Mapping[str, Any] = field(default_factory=dict)  # recipe options passes may read (target, quantize…)

    @property
    def entry(self) -> Graph:
        return self.graphs["entry"]

    def with_graphs(self, graphs: Mapping[str, Graph]) -> Program:
        merged = dict(self.graphs)
        merged.update(graphs)
        return dataclasses.replace(self, graphs=merged)

    def with_params(self, params: Mapping[str, ParamSpec]) -> Program:
        return dataclasses.replace(self, params=dict(params))

    def forward_graphs(self) -> list[str]:
        """"entry", then every other graph no block runs: the model's named forwards (a draft head such as
        DeepSeek's MTP), which the runtime calls after the entry with the hidden states it returns."""
        block_graphs = {b.graph for b in self.blocks.values()}
        return ["entry", *(g for g in self.graphs if g != "entry" and g not in block_graphs)]

    def layer_schedule(self) -> list[tuple[str, int]]:
        """(block name, block-local layer index) in execution order, read from the `block` nodes of the entry
        graph, then of each further forward; a layer's global index is its position in this list."""
        sched: list[tuple[str, int]] = []
        for g in self.forward_graphs():
            for _, n in self.graphs[g].items():
                if n.op == "block":
                    spec = self.blocks[n.attrs["block"]]
                    sched.extend((spec.name, i) for i in range(spec.count))
        return sched

    def graph_of_param(self, name: str) -> str:
        spec = self.params[name]
        return self.blocks[spec.block].graph if spec.block else "entry"

    def num_nodes(self) -> int:
        return sum(len(g) for g in self.graphs.values())


DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "fp8e4m3": 1, "i8": 1, "u8": 1}
