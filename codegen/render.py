"""Renders a typed, kernel-selected Program into the artifact's `model.py`: straight-line kernel calls.

The generated `Model.forward` runs the entry graph, calling one method per block kind inside a layer loop;
each method is the block graph written out as Python, one line per node in dataflow order. Nothing walks
the IR at run time.
"""
from __future__ import annotations

import json
import keyword
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from kiln.compiler.ir import Attrs, Graph, Node, PerLayer, Program, TensorType, TupleType, at_layer
from kiln.compiler.kv_layout import KV_CACHE_OPS, kv_cache_nodes
from kiln.compiler.ops import OPS, REQUIRED, attention_sinks
from kiln.compiler.placement import PlacementTable, local_slice, lora_local_rows, units_of
from kiln.compiler.placement import R as REPLICATED
from kiln.compiler.targets import get_target

from .emitters import EMITTERS, PACKED_WEIGHT_GEMMS, PACKED_WEIGHT_READERS, STRUCTURAL_OPS
from .errors import CodegenError

TEMPLATES = Path(__file__).resolve().parent / "templates"

# Names model.py itself uses: a value id never becomes one of these.
_RESERVED = frozenset({
    "self", "layer", "batch", "kv_caches", "weights", "device", "K", "torch", "Tensor", "ForwardBatch",
    "MAX_MODEL_LEN", "TYPE_CHECKING", "annotations", "range", "i", "_", "rank", "comm", "MESH", "EXPERTS",
    "PACKED_WEIGHTS", "NUM_LAYERS", "aux_layers", "aux",
})


def template_env() -> jinja2.Environment:
    """The jinja environment of every codegen template (strict: a missing variable is an error)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )


# ---------------------------------------------------------------- program-wide facts


def kernel_of(graph: Graph, vid: str, node: Node) -> str:
    """The kernel id of a node: "inline" for structural ops, else attrs["kernel"] (set by kernel_selection)."""
    kernel = node.attrs.get("kernel")
    if node.op in STRUCTURAL_OPS:
        return "inline" if kernel is None else kernel
    if kernel is None:
        raise CodegenError(f"%{vid} = {node.op}(...) in graph '{graph.name}' has no kernel; the kernel_selection "
                           f"pass sets attrs['kernel']", node.loc)
    if kernel not in EMITTERS:
        raise CodegenError(f"no code emitter for kernel '{kernel}' (%{vid} = {node.op} in graph '{graph.name}'); "
                           f"known kernels: {', '.join(sorted(EMITTERS))}", node.loc)
    return kernel


def _nodes(graph: Graph) -> Iterator[Node]:
    return (node for _, node in graph.items())


def used_graphs(program: Program) -> list[str]:
    """The forward graphs (entry first, then named forwards such as `mtp`), then each block graph in order of
    its first call."""
    forwards = program.forward_graphs()
    names = list(forwards)
    for f in forwards:
        for node in _nodes(program.graphs[f]):
            if node.op == "block":
                g = program.blocks[node.attrs["block"]].graph
                if g not in names:
                    names.append(g)
    return names


def kernels_used(program: Program) -> list[str]:
    """Sorted kernel ids the generated model calls (structural "inline" ops excluded)."""
    ids = set()
    for name in used_graphs(program):
        graph = program.graphs[name]
        for vid, node in graph.items():
            kernel = kernel_of(graph, vid, node)
            if kernel != "inline":
                ids.add(kernel)
    return sorted(ids)


def packed_params(program: Program) -> list[str]:
    """Params model.py holds only in the tvm library's packed GEMM layout: every use of the param (over every
    graph the model runs) is a kernel of PACKED_WEIGHT_READERS at the input it reads packed, and at least one is
    a GEMM. Anything else reading it (a slice, a torch kernel, an input other than the weight) keeps it as
    stored."""
    uses: dict[str, list[bool]] = {}  # param name -> for each use, whether it reads the packed layout
    gemm: set[str] = set()  # params some GEMM reads
    for name in used_graphs(program):
        graph = program.graphs[name]
        for vid, node in graph.items():
            if node.op != "param":
                continue
            param = node.attrs["name"]
            for user in graph.users(vid):
                unode = graph.node(user)
                kernel = kernel_of(graph, user, unode)
                at = PACKED_WEIGHT_READERS.get(kernel)
                reads = [i for i, v in enumerate(unode.inputs) if v == vid]
                uses.setdefault(param, []).append(at is not None and reads == [at])
                if kernel in PACKED_WEIGHT_GEMMS:
                    gemm.add(param)
            if vid in graph.outputs:
                uses.setdefault(param, []).append(False)
    return sorted(p for p, ok in uses.items() if p in gemm and all(ok))


# Ops that own a paged KV cache (one tensor per node per layer): MHA/GQA K/V, or MLA's latent [c_kv | k_pe].
def _kv_count(graph: Graph) -> int:
    return sum(graph.count(op) for op in KV_CACHE_OPS)


def expert_down(graph: Graph, node: Node) -> str:
    """A moe_experts' down-projection stack (its last 3-D input: expert biases, gpt-oss's, may follow it)."""
    return [i for i in node.inputs[3:] if _type_of(graph, i).rank == 3][-1]


def _type_of(graph: Graph, vid: str) -> TensorType:
    t = graph.node(vid).out
    if not isinstance(t, TensorType):
        raise CodegenError(f"%{vid} in graph '{graph.name}' has no tensor type; run shape_inference before codegen",
                           graph.node(vid).loc)
    return t


def _attrs_with_defaults(node: Node) -> dict[str, Any]:
    op = OPS.get(node.op)
    attrs = {k: v for k, v in (op.attrs.items() if op else ()) if v is not REQUIRED}
    attrs.update(node.attrs)
    return attrs


def _has_rope(node: Node) -> bool:
    """A rope node, or an attention that absorbed its q/k rope (fuse_rope_kv_write)."""
    return node.op == "rope" or (node.op == "attention" and node.attrs.get("rope") is not None)


def _rope_attrs(node: Node) -> dict[str, Any]:
    """The rope attributes of a rope node, or those an attention with a fused rope carries (defaults filled)."""
    if node.op == "rope":
        return _attrs_with_defaults(node)
    return {**{k: v for k, v in OPS["rope"].attrs.items() if v is not REQUIRED}, **node.attrs["rope"]}


def rope_layers(node: Node) -> int | None:
    """The layer count of a rope whose configuration differs by layer (a PerLayer attribute), else None."""
    counts = {len(v.values) for v in _rope_attrs(node).values() if isinstance(v, PerLayer)}
    assert len(counts) <= 1, f"per-layer rope attributes of different lengths: {counts}"
    return counts.pop() if counts else None


def rope_key(graph: Graph, vid: str, node: Node, layer: int | None = None) -> tuple:
    """Ropes sharing this key share one precomputed cos/sin table; an attention with a fused rope keys on the
    rope attributes it carries, so it shares the table the rope node would have used. A rope configured per
    layer has one key per layer (`layer`)."""
    head_dim = _type_of(graph, node.inputs[0]).shape[-1]
    attrs = _rope_attrs(node)
    return (head_dim, *((k, at_layer(attrs[k], layer)) for k in OPS["rope"].attrs))  # op-table order: theta first


def literal(v: Any) -> str:
    """A Python literal for an attribute value."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool) or v is None or isinstance(v, int | float):
        return repr(v)
    if isinstance(v, tuple | list):
        inner = ", ".join(literal(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, Attrs | dict):
        return "{" + ", ".join(f"{k!r}: {literal(v[k])}" for k in v) + "}"
    raise CodegenError(f"cannot write attribute value {v!r} as a Python literal", None)


def identifier(name: str, taken: set[str]) -> str:
    """A fresh Python identifier close to `name`, added to `taken`."""
    base = re.sub(r"\W", "_", name) or "v"
    if base[0].isdigit():
        base = f"v{base}"
    if keyword.iskeyword(base) or base in _RESERVED:
        base = f"{base}_"
    ident, n = base, 1
    while ident in taken:
        ident, n = f"{base}_{n}", n + 1
    taken.add(ident)
    return ident


# ---------------------------------------------------------------- the model as a whole


@dataclass
class _Model:
    program: Program
    max_model_len: int = 0  # MAX_MODEL_LEN of model.py: positions its rotary tables hold
    attr_of_param: dict[str, str] = field(default_factory=dict)  # ParamSpec name -> self.<attr>
    method_of_graph: dict[str, str] = field(default_factory=dict)
    rope_caches: dict[tuple, str] = field(default_factory=dict)  # rope_key -> self.<attr>
    # ropes configured per layer: (graph, value id) -> each layer's rope_key; each distinct key list -> self.<list>
    layer_ropes: dict[tuple[str, str], tuple[tuple, ...]] = field(default_factory=dict)
    rope_lists: dict[tuple[tuple, ...], str] = field(default_factory=dict)
    init_lines: list[str] = field(default_factory=list)
    packed: list[str] = field(init=False)  # params held packed for the tvm GEMM (packed_params)
    # parallel programs: placements, and the expert map of each moe_experts whose experts are split over ranks
    placements: PlacementTable = field(init=False)
    expert_maps: dict[str, str] = field(default_factory=dict)  # expert-stack param name -> self.<attr>
    experts_by_rank: dict[str, list[list[int]]] = field(default_factory=dict)  # that param -> each rank's experts

    def __post_init__(self) -> None:
        program = self.program
        self.placements = PlacementTable(program)
        taken = {"forward", "device", "rank", "comm"}
        graphs = used_graphs(program)
        for g in graphs[1:]:
            self.method_of_graph[g] = identifier(g, taken)
            if g in program.forward_graphs() and self.method_of_graph[g] != g:  # the manifest names it so
                raise CodegenError(f"forward '{g}' cannot be a model.py method name (it is reserved)", None)
        for spec in program.params.values():
            self.attr_of_param[spec.name] = identifier(spec.name, taken)
        self._expert_maps(graphs, taken)
        self.packed = packed_params(program)
        ropes = []
        for g in graphs:
            for vid, n in program.graphs[g].items():
                if not _has_rope(n):
                    continue
                layers = rope_layers(n)
                if layers is None:
                    ropes.append(rope_key(program.graphs[g], vid, n))
                    continue
                keys = tuple(rope_key(program.graphs[g], vid, n, i) for i in range(layers))
                self.layer_ropes[g, vid] = keys
                ropes.extend(keys)
        distinct = list(dict.fromkeys(ropes))
        for k, key in enumerate(distinct):
            self.rope_caches[key] = identifier("rope_cache" if len(distinct) == 1 else f"rope_cache_{k}", taken)
        for keys in dict.fromkeys(self.layer_ropes.values()):
            self.rope_lists[keys] = identifier("rope_cache_by_layer", taken)
        self._init_lines()

    def _expert_maps(self, graphs: list[str], taken: set[str]) -> None:
        """Experts placed on ep groups: every rank's global expert ids (EXPERTS in model.py) and a map tensor
        global id -> local index (-1: another rank's) built at load for the rank."""
        mesh = self.placements.mesh
        for g in graphs:
            for _, node in self.program.graphs[g].items():
                if node.op not in ("moe_experts", "moe_experts_a2a"):
                    continue
                down_vid = expert_down(self.program.graphs[g], node)
                down = self.program.graphs[g].node(down_vid)
                spec = self.program.params[down.attrs["name"]]
                shard = (self.placements.of(self.program.graphs[g], down_vid) or REPLICATED).shard(0)
                if shard is None or spec.name in self.expert_maps:
                    continue
                seg = shard.segments[0]
                self.experts_by_rank[spec.name] = [
                    units_of(seg, mesh.ep, mesh.coord("ep", r), shard.order) for r in range(mesh.world)]
                self.expert_maps[spec.name] = identifier(f"experts_{spec.block or 'top'}", taken)

    def _init_lines(self) -> None:
        program, lines = self.program, self.init_lines
        if self.packed:
            lines.append("K.pack_weights(weights, PACKED_WEIGHTS)  # in place: each packed weight held once")
        for spec in program.params.values():
            if spec.block is None:
                lines.append(f"self.{self.attr_of_param[spec.name]} = weights[{json.dumps(spec.name)}]")
        for block in program.blocks.values():
            specs = [s for s in program.params.values() if s.block == block.name]
            if not specs:
                continue
            lines.append(f"# block {block.name}: {block.count} layers, weights indexed by layer")
            for spec in specs:
                name = _layer_pattern(spec, block.name)
                assert "{" not in spec.name and '"' not in spec.name, f"odd param name {spec.name!r}"
                lines.append(f'self.{self.attr_of_param[spec.name]} = [weights[f"{name}"] '
                             f"for i in range({block.count})]")
        for name, attr in self.expert_maps.items():
            experts = program.params[name].shape[0]
            lines.append(f"# {name}: this rank's experts of {experts} (global id -> local index, -1: another rank's)")
            lines.append(f"self.{attr} = K.expert_map(EXPERTS[{json.dumps(name)}][rank], {experts}, self.device)")
        if self.rope_caches:
            lines.append("# rotary cos/sin tables, one per distinct rope configuration")
        defaults = OPS["rope"].attrs
        for key, attr in self.rope_caches.items():
            head_dim, *items = key
            rope = dict(items)
            if rope["scaling"] == "longrope":  # which factor set the table takes (rope_cache picks it the same way)
                orig = rope["original_max_position"]
                lines.append(f"# LongRoPE: MAX_MODEL_LEN {self.max_model_len} "
                             + (f"> original_max_position {orig}: long_factor" if self.max_model_len > orig else
                                f"<= original_max_position {orig}: short_factor") + " for every sequence (docs/rope.md)")
            extra = "".join(f", {k}={literal(v)}" for k, v in items if k == "theta" or v != defaults[k])
            lines.append(f"self.{attr} = K.rope_cache({head_dim}, MAX_MODEL_LEN{extra}).to(self.device)")
        for keys, attr in self.rope_lists.items():
            lines.append(f"self.{attr} = [{', '.join(f'self.{self.rope_caches[k]}' for k in keys)}]  # by layer")

    def packed_weights(self) -> list[str]:
        """PACKED_WEIGHTS of model.py as Python expressions: a name, or a block param's names over its layers."""
        out = []
        for name in self.packed:
            spec = self.program.params[name]
            if spec.block is None:
                out.append(json.dumps(name))
            else:
                count = self.program.blocks[spec.block].count
                out.append(f'*(f"{_layer_pattern(spec, spec.block)}" for i in range({count}))')
        return out


def _layer_pattern(spec, block: str) -> str:
    """A block param's checkpoint-free weight name with the layer index as `{i}`: `decoder.{i}.wq`."""
    return spec.layer_name(0).replace(f"{block}.0.", f"{block}.{{i}}.", 1)


# ---------------------------------------------------------------- one function per graph


ContextField = Callable[["_Function", str, Node], str]


def _kv_cache_field(fn: _Function, vid: str, node: Node) -> str:
    j = fn.next_kv
    fn.next_kv += 1
    if fn.layered:
        m = fn.kv_per_layer
        return "kv_caches[layer]" if m == 1 else f"kv_caches[layer * {m} + {j}]"
    return f"kv_caches[{j}]"


def _rope_cache_field(fn: _Function, vid: str, node: Node) -> str:
    keys = fn.model.layer_ropes.get((fn.graph.name, vid))
    if keys is not None:  # a rope configured per layer (Gemma 3's local and global layers): this layer's table
        return f"self.{fn.model.rope_lists[keys]}[layer]"
    return f"self.{fn.model.rope_caches[rope_key(fn.graph, vid, node)]}"


def _scale_field(fn: _Function, vid: str, node: Node) -> str:
    scale = node.attrs.get("scale")
    if scale is None:
        scale = _type_of(fn.graph, node.inputs[0]).shape[-1]
        if node.op == "mla_attention":  # q is [q_nope | q_pe]
            scale += _type_of(fn.graph, node.inputs[1]).shape[-1]
        scale = scale ** -0.5
    return literal(float(scale))


def _kv_scales_field(fn: _Function, vid: str, node: Node) -> str:
    """`, k_scale=..., v_scale=...` for an attention over an fp8 KV cache (inputs 4 and 5), `, kv_scale=...`
    for an MLA latent cache (input 6), else nothing."""
    if not node.attrs.get("kv_dtype"):
        return ""
    if node.op == "mla_attention":
        return f", kv_scale={fn.expr[node.inputs[5]]}"
    k_scale, v_scale = (fn.expr[i] for i in node.inputs[3:5])
    return f", k_scale={k_scale}, v_scale={v_scale}"


def _fused_rope_field(fn: _Function, vid: str, node: Node) -> str:
    """`, rope_cache=self.<table>` for an attention that ropes its own q/k (fuse_rope_kv_write), else nothing."""
    return f", rope_cache={_rope_cache_field(fn, vid, node)}" if _has_rope(node) else ""


def _attn_softcap_field(fn: _Function, vid: str, node: Node) -> str:
    """`, softcap=<cap>` for an attention that soft-caps its scores (Gemma 2), else nothing."""
    cap = node.attrs.get("softcap")
    if isinstance(cap, PerLayer):  # soft-capped at some layers only: this layer's cap (0: none)
        return f", softcap={literal(tuple(float(c) for c in cap.values))}[layer]"
    return f", softcap={literal(float(cap))}" if cap else ""


def _attn_sinks_field(fn: _Function, vid: str, node: Node) -> str:
    """`, sinks=<per-head sink logits>` for an attention with sinks (gpt-oss), else nothing."""
    index = attention_sinks(len(node.inputs), node.attrs)
    return f", sinks={fn.expr[node.inputs[index]]}" if index is not None else ""


def _expert_activation_field(fn: _Function, vid: str, node: Node) -> str:
    """`, activation=..., alpha=..., limit=...` for experts whose activation is not plain SwiGLU, else nothing."""
    activation = node.attrs.get("activation", "swiglu")
    if activation == "swiglu":
        return ""
    return (f", activation={literal(activation)}, alpha={literal(float(node.attrs.get('alpha', 1.702)))}, "
            f"limit={literal(float(node.attrs.get('limit', 7.0)))}")


def _expert_map_field(fn: _Function, vid: str, node: Node) -> str:
    """`, local_experts=self.<map>` for a moe_experts whose experts are split over ranks, else nothing."""
    down = fn.graph.node(expert_down(fn.graph, node))
    attr = fn.model.expert_maps.get(down.attrs.get("name")) if down.op == "param" else None
    return f", local_experts=self.{attr}" if attr else ""


def _expert_owners_field(fn: _Function, vid: str, node: Node) -> str:
    """moe_experts_a2a: every rank's experts (global ids in local order), from which it routes each pair."""
    down = fn.graph.node(expert_down(fn.graph, node))
    return f"EXPERTS[{json.dumps(down.attrs['name'])}]"


def _gathered_size_field(fn: _Function, vid: str, node: Node) -> str:
    """The global size of an all_gather's dim: what is left of the gathered parts once padding is dropped."""
    return literal(int(_type_of(fn.graph, vid).shape[node.attrs["dim"]]))


def _lora_rows_field(fn: _Function, vid: str, node: Node) -> str:
    """A lora branch's per-module output rows on this rank (a column-parallel branch holds each module's share)."""
    return literal(lora_local_rows(fn.graph, node, fn.model.placements.mesh))


def _dp_counts_field(fn: _Function, vid: str, node: Node) -> str:
    """The batch's per-rank row counts a data-parallel gather/scatter splits by: tokens, or logits rows."""
    return "batch.dp_num_rows" if node.attrs.get("rows") == "logits" else "batch.dp_num_tokens"


# Fields a kernel template may name besides inputs and attributes, and how codegen derives each.
CONTEXT_FIELDS: dict[str, ContextField] = {
    "attn_softcap": _attn_softcap_field,  # an attention's score soft-cap (Gemma 2), as a keyword
    "attn_sinks": _attn_sinks_field,  # an attention's per-head sink logits (gpt-oss), as a keyword
    "expert_activation": _expert_activation_field,  # experts' activation when not SwiGLU (gpt-oss), as keywords
    "dp_counts": _dp_counts_field,  # data-parallel attention: the ranks' row counts of this step
    "expert_map": _expert_map_field,  # experts split over ranks: this rank's global -> local expert map
    "expert_owners": _expert_owners_field,  # moe_experts_a2a: every rank's experts (EXPERTS of model.py)
    "gathered_size": _gathered_size_field,  # all_gather: the global (unpadded) size of the gathered dim
    "fused_rope": _fused_rope_field,  # the cos/sin table of an attention with a fused rope, as a keyword
    "kv_scales": _kv_scales_field,  # an fp8 KV cache's per-head scales, as keyword arguments
    "kv_cache": _kv_cache_field,
    "lora_rows": _lora_rows_field,  # a lora branch's per-module output rows on this rank  # this attention's KV tensor: running index over the layer schedule
    "rope_cache": _rope_cache_field,  # the precomputed cos/sin table of this rope's configuration
    "scale": _scale_field,  # attrs.scale, or head_dim ** -0.5
}


def decoder_layers(graph: Graph, program: Program) -> int:
    """The decoder layers `graph` runs through its block calls (every block's count, in order): what model.py's
    NUM_LAYERS says and forward's `aux_layers` index."""
    return sum(program.blocks[node.attrs["block"]].count for node in _nodes(graph) if node.op == "block")


class _Function:
    """Writes one graph as straight-line Python: `forward` (entry) or a block method (`layered`). The entry's
    block loops also keep, when asked per step (`aux_layers`), the hidden states entering chosen layers (an
    EAGLE-3 head reads three); the loop that runs without them is the plain one."""

    def __init__(self, model: _Model, graph: Graph, *, layered: bool):
        self.model, self.graph, self.layered = model, graph, layered
        self.num_layers = 0 if layered or graph.name != "entry" else decoder_layers(graph, model.program)
        self.layers_before = 0  # decoder layers of the block calls emitted so far (entry)
        self.expr: dict[str, str] = {}  # value id -> local name or inline expression
        self.taken: set[str] = set()
        self.lines: list[str] = []
        self.skip: set[str] = set()
        self.next_kv = 0
        self.kv_per_layer = _kv_count(graph)
        self.args: list[str] = []

    def emit(self) -> list[str]:
        handlers = {"input": self._input, "param": self._param, "block": self._block, "getitem": self._getitem,
                    "view": self._view, "slice": self._slice}
        for vid, node in self.graph.items():
            if vid in self.skip:
                continue
            handlers.get(node.op, self._kernel)(vid, node)
        outs = [self.expr[o] for o in self.graph.outputs]
        if self.num_layers:
            self.lines.append("if aux_layers:")
            self.lines.append(f"    return {outs[0]}, [aux[i] for i in aux_layers]")
        if len(outs) > 1 and self.graph.name == "entry":
            # the hidden states after the logits feed the named forwards (a draft head) only when asked for
            self.lines.append(f"return ({', '.join(outs)}) if return_hidden else {outs[0]}")
        else:
            self.lines.append(f"return {', '.join(outs)}")
        return self.lines

    def _local(self, vid: str) -> str:
        self.expr[vid] = identifier(vid, self.taken)
        return self.expr[vid]

    def _input(self, vid: str, node: Node) -> None:
        if self.layered:
            self.args.append(self._local(vid))
        elif vid == self.graph.inputs[0]:
            self.expr[vid] = "batch.input_ids"
        elif self.graph.name != "entry":  # a named forward's hidden-state arguments
            self.args.append(self._local(vid))
        else:
            raise CodegenError(f"the entry graph takes {len(self.graph.inputs)} inputs; model.py feeds only the "
                               "token ids (batch.input_ids)", node.loc)

    def _param(self, vid: str, node: Node) -> None:
        spec = self.model.program.params[node.attrs["name"]]
        attr = f"self.{self.model.attr_of_param[spec.name]}"
        if spec.block is not None and not self.layered:
            raise CodegenError(f"graph '{self.graph.name}' reads block param '{spec.name}' outside its block",
                               node.loc)
        self.expr[vid] = f"{attr}[layer]" if spec.block is not None else attr

    def _assign(self, vid: str, rhs: str) -> None:
        self.lines.append(f"{self._local(vid)} = {rhs}")

    def _view(self, vid: str, node: Node) -> None:
        shape = tuple(node.attrs["shape"])
        local = self.model.placements.local(self.graph, vid)  # a rank's heads of a sharded projection
        if local is not None and self.model.placements.parallel:
            shape = tuple(local.shape[-len(shape):])
        self._assign(vid, f"{self.expr[node.inputs[0]]}.unflatten(-1, {literal(shape)})")

    def _slice(self, vid: str, node: Node) -> None:
        start, stop = node.attrs["start"], node.attrs["stop"]
        src = self.model.placements.of(self.graph, node.inputs[0])
        last = _type_of(self.graph, node.inputs[0]).rank - 1
        shard = src.shard(last) if src is not None and src.kind == "S" else None
        if shard is not None:  # a segment of a sharded fused output (q of [q | k | v]): where it is on this rank
            start, stop = local_slice(shard, start, stop, self.model.placements.mesh)
        self._assign(vid, f"{self.expr[node.inputs[0]]}[..., {start}:{stop}]")

    def _getitem(self, vid: str, node: Node) -> None:
        self._assign(vid, f"{self.expr[node.inputs[0]]}[{node.attrs['index']}]")

    def _block(self, vid: str, node: Node) -> None:
        if self.layered:
            raise CodegenError(f"block graph '{self.graph.name}' calls block '{node.attrs['block']}'; blocks nest "
                               "only in the entry graph", node.loc)
        program = self.model.program
        spec = program.blocks[node.attrs["block"]]
        method = self.model.method_of_graph[spec.graph]
        per_layer = _kv_count(program.graphs[spec.graph])
        base = self.next_kv
        self.next_kv += spec.count * per_layer
        kv = "kv_caches" if base == 0 or per_layer == 0 else f"kv_caches[{base}:]"
        h = self._local(vid)
        self.lines.append(f"{h} = {self.expr[node.inputs[0]]}")
        loop = [f"for layer in range({spec.count}):  # block {spec.name}",
                f"    {h} = self.{method}(layer, {h}, batch, {kv})"]
        if not self.num_layers:
            self.lines.extend(loop)
            return
        first, self.layers_before = self.layers_before, self.layers_before + spec.count
        index = "layer" if first == 0 else f"layer + {first}"  # the global decoder layer
        self.lines.append("if aux_layers:  # keep the hidden states entering the layers an EAGLE-3 head reads")
        if first == 0:
            self.lines.append("    aux = {}")
        self.lines.append(f"    {loop[0]}")
        self.lines.append(f"        if {index} in aux_layers:")
        self.lines.append(f"            aux[{index}] = {h}")
        self.lines.append(f"    {loop[1]}")
        if self.layers_before == self.num_layers:
            self.lines.append(f"    aux[{self.num_layers}] = {h}  # NUM_LAYERS: the last layer's output")
        self.lines.append("else:")
        self.lines.extend(f"    {line}" for line in loop)

    def _kernel(self, vid: str, node: Node) -> None:
        kernel = kernel_of(self.graph, vid, node)
        template = EMITTERS[kernel]
        inputs = [self.expr[i] for i in node.inputs]
        attrs = _attrs_with_defaults(node)
        fields: dict[str, str] = {"args": ", ".join(inputs)}
        for _, name, _, _ in string.Formatter().parse(template):
            if name is None or name.isdigit() or name == "args":
                continue
            if name in CONTEXT_FIELDS:
                fields[name] = CONTEXT_FIELDS[name](self, vid, node)
            elif name in attrs and isinstance(attrs[name], PerLayer):
                if not self.layered:
                    raise CodegenError(f"%{vid} = {node.op}: per-layer attribute '{name}' outside a block", node.loc)
                fields[name] = f"{literal(attrs[name].values)}[layer]"  # the value at this layer
            elif name in attrs:
                fields[name] = literal(attrs[name])
            else:
                raise CodegenError(f"kernel '{kernel}' needs '{name}', which %{vid} = {node.op} does not carry",
                                   node.loc)
        try:
            call = template.format(*inputs, **fields)
        except IndexError:
            raise CodegenError(f"kernel '{kernel}' takes more inputs than %{vid} = {node.op} has "
                               f"({len(inputs)})", node.loc) from None
        if isinstance(node.out, TupleType):
            self._assign_tuple(vid, node, call)
        else:
            self._assign(vid, call)

    def _assign_tuple(self, vid: str, node: Node, call: str) -> None:
        users = self.graph.users(vid)
        index = [self.graph.node(u).attrs.get("index") for u in users]
        unpack = (vid not in self.graph.outputs and all(self.graph.node(u).op == "getitem" for u in users)
                  and len(set(index)) == len(index))
        if not unpack:
            self._assign(vid, call)
            return
        names = ["_"] * len(node.out.items)
        for u, i in zip(users, index, strict=True):
            names[i] = self._local(u)
            self.skip.add(u)
        self.lines.append(f"{', '.join(names)} = {call}")


def _methods(model: _Model) -> Iterator[dict[str, Any]]:
    program = model.program
    forwards = program.forward_graphs()
    for g, method in model.method_of_graph.items():
        if g in forwards:
            continue
        fn = _Function(model, program.graphs[g], layered=True)
        lines = fn.emit()
        if len(fn.args) != 1:
            raise CodegenError(f"block graph '{g}' takes {len(fn.args)} inputs; a block maps one hidden state "
                               "to the next", None)
        blocks = [b.name for b in program.blocks.values() if b.graph == g]
        yield {"name": method, "arg": fn.args[0], "lines": lines, "blocks": ", ".join(blocks),
               "kv_per_layer": fn.kv_per_layer}


def _forwards(model: _Model, kv_base: int) -> Iterator[dict[str, Any]]:
    """The named forwards (draft heads) as methods `name(batch, *hidden, kv_caches)`; their caches follow the
    entry's in `kv_caches`."""
    program = model.program
    for g in program.forward_graphs()[1:]:
        fn = _Function(model, program.graphs[g], layered=False)
        fn.next_kv = kv_base
        lines = fn.emit()
        num_kv = fn.next_kv - kv_base
        yield {"name": model.method_of_graph[g], "args": fn.args, "lines": lines, "kv_range": (kv_base, fn.next_kv)}
        kv_base += num_kv


def expert_placement(program: Program) -> dict[str, list[list[int]]]:
    """Expert stacks split over ranks: each rank's global expert ids, in local order (the manifest and model.py
    record the same)."""
    model = _Model.__new__(_Model)
    model.program, model.placements, model.expert_maps, model.experts_by_rank = program, PlacementTable(program), {}, {}
    model._expert_maps(used_graphs(program), set())
    return model.experts_by_rank


def vocab_size(program: Program) -> int:
    """The width of the logits: the entry graph's first output's last dimension, else the config's vocab."""
    node = program.entry.node(program.entry.outputs[0])
    out = node.out if node.op != "hidden_rows" else None  # an embedding model's output is [rows, hidden]
    vocab = out.shape[-1] if isinstance(out, TensorType) and isinstance(out.shape[-1], int) else None
    vocab = vocab or program.config.get("vocab") or program.config.get("vocab_size")
    if not isinstance(vocab, int):
        raise CodegenError("cannot tell the vocabulary size: the entry graph's output is untyped and the config "
                           "has no 'vocab'", None)
    return vocab


def render_model(program: Program, *, kiln_version: str, recipe_hash: str, max_model_len: int,
                 recipe_file: str | None = None) -> str:
    """The source of the artifact's `model.py` for `program` (typed, every compute node kernel-selected).

    Deterministic: the same program and arguments give the same text. Raises CodegenError for a node codegen
    cannot emit (no kernel, unknown kernel id, missing type).
    """
    kernels_used(program)  # validates every node's kernel before anything is written
    model = _Model(program, int(max_model_len))
    forward = _Function(model, program.entry, layered=False)
    forward_lines = forward.emit()
    forwards = list(_forwards(model, forward.next_kv))
    return template_env().get_template("model.py.j2").render(
        kiln_version=kiln_version,
        recipe_hash=recipe_hash,
        recipe_file=Path(recipe_file).name if recipe_file else None,
        program_name=program.name,
        dtype=program.dtype,
        max_model_len=int(max_model_len),
        vocab_size=vocab_size(program),
        num_kv_caches=len(kv_cache_nodes(program)),
        init_lines=model.init_lines,
        packed_weights=model.packed_weights(),
        forward_lines=forward_lines,
        returns_hidden=len(program.entry.outputs) > 1,
        num_layers=forward.num_layers,
        forwards=forwards,
        methods=list(_methods(model)),
        kernels_module=get_target(str(program.meta.get("target", "cpu"))).kernel_modules[0],
        mesh=json.dumps(model.placements.mesh.to_json(), sort_keys=True) if model.placements.parallel else None,
        experts=json.dumps(model.experts_by_rank, sort_keys=True) if model.experts_by_rank else None,
    )


__all__ = ["CONTEXT_FIELDS", "decoder_layers", "identifier", "kernel_of", "kernels_used", "kv_cache_nodes", "literal",
           "render_model", "template_env", "used_graphs", "vocab_size"]
