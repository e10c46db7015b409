"""Places every value of the program on the recipe's device mesh and inserts the collectives that follows."""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from kiln.compiler import Attrs, Graph, Node, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.ir import TensorType
from kiln.compiler.ops import OPS, attention_sinks
from kiln.compiler.options import RecipeOptions
from kiln.compiler.placement import (
    LINEAR_OPS,
    REDUCING_INPUTS,
    Mesh,
    Placement,
    PlacementError,
    R,
    Segment,
    Shard,
    T,
    infer_placement,
    linear_weight_params,
    local_units,
    mesh_of,
    quantized_param_placements,
    sharded,
)
from kiln.dsl.errors import SourceError

GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up: the MLP's width sharded through it


class PlacementPlanError(PassError):
    """A model shape the mesh cannot split (heads, KV heads, FFN width, experts)."""


# Where a column-parallel projection's output may go, walking forward from it: through these ops a value keeps
# its [T, heads, dim] layout (per-head norms of rank-3 values included), until an attention reads it.
_HEAD_THROUGH = ("rope", "deinterleave", "slice", "rms_norm")


@dataclass
class _Seg:
    segment: Segment
    replicable: bool  # KV heads: fewer than ranks may be replicated
    role: str  # what reads it, for messages: "query heads", "KV heads", "FFN width"


@register_pass("place_parallel", requires=("shape_inference",),
               after=("quantize_weights", "fuse_qkv", "fuse_gate_up", "fuse_expert_gate_up", "fuse_silu_mul",
                      "fuse_add_rms_norm", "mla_absorption", "fuse_dequant_linear", "quantize_kv_cache",
                      "fuse_rope_kv_write"),
               before=("dead_code_elimination", "kernel_selection", "cuda_graph_plan"))
class PlaceParallel(Pass):
    """Requires: typed, fused IR and the recipe's `parallel { tp; dp; ep }` (a single device: no change).
    Guarantees: every node carries `placement` (compiler/placement.py; R, P, S..., T, L) and every param a
    `sharding`, derived Megatron-style from the dataflow, never from names: a projection whose output reaches
    attention heads (q/k/v, MLA queries) or a SwiGLU is column-parallel, sharded per segment of a fused output
    (q | k | v, gate | up); a projection of a sharded value is row-parallel and partial, its bias added once after
    the reduction; experts split by `ep` groups of whole experts and by width inside a group; the embedding and
    LM head split the vocabulary (padded to a multiple of the ranks) with a masked lookup + all_reduce and a logits
    all_gather. A partial value is all-reduced where it meets anything but a reduction. With dp > 1 attention is
    data-parallel (token-sharded, weights replicated): each MLP gathers every rank's rows (`dp_gather`) and
    reduce-scatters its partial output back (`dp_scatter`), except a MoE with one rank per expert group whose
    rows nothing else gathers (`moe_experts_a2a`: all_to_all to the experts' ranks and back); logits rows are
    gathered at the end. KV heads that do not divide the ranks are replicated when the ranks divide them; any
    other shape is an error at the recipe's `parallel` line naming the tensor and the numbers. Global shapes are
    unchanged."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        mesh = mesh_of(program)
        if mesh.world == 1:
            return program
        options = RecipeOptions.from_meta(program.meta)
        planner = _Planner(program, mesh, options)
        graphs = {name: planner.place(name, graph) for name, graph in program.graphs.items()}
        if mesh.ep > 1 and not planner.saw_experts:
            planner.fail(f"parallel.ep = {mesh.ep} but model {program.name} has no experts (moe_experts)",
                         "parallel.ep")
        params = {name: dataclasses.replace(spec, sharding=Attrs({"placement": str(planner.params[name])}))
                  if name in planner.params and planner.params[name] != R else spec
                  for name, spec in program.params.items()}
        ctx.stats.update(dict(sorted(planner.inserted.items())))
        return dataclasses.replace(program, params=params, graphs={**program.graphs, **graphs})


@dataclass
class _Planner:
    program: Program
    mesh: Mesh
    options: RecipeOptions
    params: dict[str, Placement] = field(default_factory=dict)
    inserted: Counter = field(default_factory=Counter)
    saw_experts: bool = False

    # ------------------------------------------------------------ errors
    def fail(self, message: str, key: str | None = None) -> None:
        key = key or ("parallel.dp" if self.mesh.attention == "dp" else "parallel.tp")
        loc = self.options.loc(key) or self.options.loc("parallel")
        if loc is not None:
            raise SourceError(message, loc)
        raise PlacementPlanError(message)

    def _axis_words(self, axis: str) -> str:
        m = self.mesh
        if axis == "ep":
            return f"ep = {m.ep} expert groups"
        if axis == "etp":
            return f"{m.etp} ranks per expert group (tp x dp / ep)"
        return f"tp = {m.tp} ranks" if m.attention == "tp" else f"tp x dp = {m.world} ranks"

    # ------------------------------------------------------------ a graph
    def place(self, name: str, graph: Graph) -> Graph:
        self.graph, self.name = graph, name
        self.pl: dict[str, Placement] = {}
        self.cur: dict[str, str] = {}  # value id -> the id its users read (a gathered copy)
        self.reduced: dict[str, str] = {}
        self.out: list[tuple[str, Node]] = []
        self.taken = set(graph.g)
        self.emitted: set[str] = set()
        self.columns = self._column_plan()
        self.gather_after = self._dp_gathers()
        for vid, node in graph.items():
            if node.op == "param":
                continue  # emitted with its first reader, once that decided its placement
            self._visit(vid, node)
        outputs = []
        for o in graph.outputs:
            v = self.cur[o]
            if self.pl[v].is_partial:
                v = self._reduce(v)
            outputs.append(v)
        g = Graph(graph.name)
        for vid, node in self.out:
            g.add(vid, node)
        g.outputs = tuple(outputs)
        return g

    def _fresh(self, hint: str) -> str:
        vid, n = hint, 1
        while vid in self.taken:
            vid, n = f"{hint}_{n}", n + 1
        self.taken.add(vid)
        return vid

    def _emit(self, vid: str, node: Node, placement: Placement) -> str:
        self.pl[vid] = placement
        self.out.append((vid, node.with_(attrs=node.attrs.replace(placement=str(placement)))))
        self.emitted.add(vid)
        self.cur.setdefault(vid, vid)
        return vid

    def _new(self, op: str, inputs: tuple[str, ...], hint: str, placement: Placement, loc=None, **attrs) -> str:
        types = [self._type(i) for i in inputs]
        out = OPS[op].infer(types, Attrs(attrs))
        vid = self._fresh(hint)
        self.inserted[op] += 1
        return self._emit(vid, Node(op, inputs, Attrs(attrs), out, loc), placement)

    def _type(self, vid: str):
        for v, n in reversed(self.out):
            if v == vid:
                return n.out
        return self.graph.node(vid).out

    def _input_placement(self, vid: str) -> Placement:
        if self.mesh.attention == "dp" and (self.name not in self.program.forward_graphs()
                                            or vid == self.graph.inputs[0]):
            return T
        return R

    # ------------------------------------------------------------ one node
    def _visit(self, vid: str, node: Node) -> None:
        if node.op == "input":
            self._emit(vid, node, self._input_placement(vid))
            return
        ins = [i if self.graph.node(i).op == "param" else self.cur[i] for i in node.inputs]
        self._decide_params(vid, node, ins)
        for k, i in enumerate(ins):
            if self.graph.node(node.inputs[k]).op == "param" and i not in self.emitted:
                self._emit(i, self.graph.node(i), self.params.get(self.graph.node(i).attrs["name"], R))
        ins = self._reductions(node, ins)
        bias = None
        n_w = linear_weight_params(node) if node.op in LINEAR_OPS else 0
        if n_w and len(ins) == 2 + n_w and self._row_parallel(ins[0]):
            bias, ins = ins[-1], ins[:-1]  # row-parallel: the bias is added once, after the reduction
        new = node.with_(inputs=tuple(ins))
        if node.op == "moe_experts" and self.pl[ins[0]].kind == "T":  # rows left on their ranks (_dp_gathers)
            new = new.with_(op="moe_experts_a2a")
            self.inserted["moe_experts_a2a"] += 1
        try:
            placement = infer_placement(new, [self.pl[i] for i in ins], [self._type(i) for i in ins])
        except PlacementError as e:
            where = f" (at {node.loc})" if node.loc else ""
            raise PlacementPlanError(f"graph {self.name!r}: %{vid} = {node.op}: {e}{where}") from None
        self._emit(vid, new, placement)
        if bias is not None:
            summed = self._reduce(vid)
            self.cur[vid] = self._new("bias_add", (summed, bias), f"{vid}_bias", self.pl[summed], node.loc)
        if node.op == "logits" and placement.kind == "S":
            self.cur[vid] = self._new("all_gather", (vid,), f"{vid}_gathered", R, node.loc, dim=1)
        elif node.op == "logits" and placement.kind == "L":
            self.cur[vid] = self._new("dp_gather", (vid,), f"{vid}_gathered", R, node.loc, rows="logits")
        if vid in self.gather_after:
            self.cur[vid] = self._new("dp_gather", (vid,), f"{vid}_gathered", R, node.loc, rows="tokens")

    def _reductions(self, node: Node, ins: list[str]) -> list[str]:
        """Partial inputs of an op that does not reduce them are reduced first (an add of two partials is
        still a partial sum, and stays one)."""
        pls = [self.pl[i] for i in ins]
        if node.op == "add" and all(p.is_partial for p in pls):
            return ins
        ok = REDUCING_INPUTS.get(node.op, ()) if node.op != "add" else ()
        return [self._reduce(i) if p.is_partial and k not in ok else i for k, (i, p) in enumerate(zip(ins, pls))]

    def _reduce(self, vid: str) -> str:
        if vid not in self.reduced:
            if self.mesh.attention == "dp":
                self.reduced[vid] = self._new("dp_scatter", (vid,), f"{vid}_scattered", T)
            else:
                self.reduced[vid] = self._new("all_reduce", (vid,), f"{vid}_reduced", R)
        return self.reduced[vid]

    # ------------------------------------------------------------ params
    def _set(self, name: str, placement: Placement) -> None:
        have = self.params.setdefault(name, placement)
        if have != placement:
            raise PlacementPlanError(f"param {name!r} is read as {have} and as {placement}; it cannot be both")

    def _weight_params(self, node: Node, weight: str, logical: Placement) -> tuple[Placement, ...]:
        """The placements of a linear's weight params for its [N, K] weight placed `logical` (a float weight:
        that; a quantized one: each packed/scale param's, compiler/placement.py), checked per rank: a rank's
        share of every segment holds whole packed words, groups and blocks."""
        if node.op == "linear":
            return (logical,)
        shard, column = logical.shard(0) or logical.shard(1), logical.shard(0) is not None
        if node.op == "linear_fp8":
            factor = node.attrs["block"] if node.attrs.get("granularity") == "block" else 1
        else:  # int4: words of 8 output columns (qzeros; AWQ's qweight too), of 8 input rows (GPTQ's qweight)
            factor = node.attrs["group"] if not column and node.attrs["format"] == "awq" else 8
        n = self.mesh.axis_size(shard.axis)
        spec = self.program.params[weight]
        for seg in shard.segments:
            rows = local_units(seg, n) * seg.size
            if rows % factor:
                what = "output rows" if column else "input columns"
                self.fail(f"{spec.name} ('{', '.join(spec.source) or spec.name}'): {node.op} "
                          f"{node.attrs.get('format') or node.attrs.get('granularity')} needs each rank's share of "
                          f"the weight's {what} in multiples of {factor}, but a segment of {seg.units} x {seg.size} "
                          f"over {n} ranks leaves {rows} ({rows} % {factor} = {rows % factor})")
        try:
            return quantized_param_placements(node, logical)
        except PlacementError as e:
            self.fail(f"{spec.name}: {e}")
            raise

    def _param_of(self, vid: str) -> str | None:
        n = self.graph.node(vid)
        return n.attrs["name"] if n.op == "param" else None

    def _row_parallel(self, x: str) -> bool:
        """A linear of `x` is row-parallel: x arrives sharded on its last dim."""
        p = self.pl[x]
        return p.kind == "S" and p.shard(self._type(x).rank - 1) is not None

    def _decide_params(self, vid: str, node: Node, ins: list[str]) -> None:
        op, mesh = node.op, self.mesh
        names = [self._param_of(i) for i in node.inputs]
        if op in LINEAR_OPS:
            n_w = linear_weight_params(node)
            if not all(names[1:1 + n_w]):
                return
            if vid in self.columns:
                segs = tuple(s.segment for s in self.columns[vid])
                logical = sharded(Shard(0, segs))
                if len(names) > 1 + n_w and names[1 + n_w]:
                    self._set(names[1 + n_w], logical)  # the bias, sharded as the weight's rows
            elif self._row_parallel(ins[0]):
                x = self.pl[ins[0]]
                xs = x.shard(self._type(ins[0]).rank - 1)
                logical = sharded(Shard(1, xs.segments, xs.axis))
            else:
                return
            for name, placement in zip(names[1:1 + n_w], self._weight_params(node, names[1], logical), strict=True):
                self._set(name, placement)
        elif op in ("embedding", "logits") and names[1]:
            if mesh.attention == "tp":
                vocab = self.program.params[names[1]].shape[0]
                padded = -(-vocab // mesh.world) * mesh.world
                self._set(names[1], sharded(Shard(0, (Segment(vocab, 1, padded if padded != vocab else 0),))))
        elif op == "moe_experts":
            self._experts(node, names)
        elif op == "mla_attention" and names[4]:
            q = self.pl.get(ins[0])
            if q is not None and q.kind == "S":
                heads = q.shards[0].segments[0].units
                w = self.program.params[names[4]]
                self._set(names[4], sharded(Shard(0, (Segment(heads, w.shape[0] // heads),))))
        elif op == "attention":
            k, q = self.pl.get(ins[1]), self.pl.get(ins[0])
            sinks = attention_sinks(len(ins), node.attrs)
            for name in names[3:5] if node.attrs.get("kv_dtype") else ():  # per-KV-head fp8 scales
                if name and k is not None and k.kind == "S":
                    self._set(name, sharded(Shard(0, k.shards[0].segments)))
            if sinks is not None and names[sinks] and q is not None and q.kind == "S":  # one per query head
                self._set(names[sinks], sharded(Shard(0, q.shards[0].segments, q.shards[0].axis)))

    def _experts(self, node: Node, names: list[str | None]) -> None:
        self.saw_experts = True
        mesh = self.mesh
        if not all(names[3:]):
            raise PlacementPlanError(f"graph {self.name!r}: moe_experts reads expert weights that are not params")
        mats = [n for n in names[3:] if len(self.program.params[n].shape) == 3]
        biases = names[3 + len(mats):]
        down = self.program.params[mats[-1]]
        experts, ffn = down.shape[0], down.shape[2]
        if experts % mesh.ep:
            self.fail(f"{mats[-1]}: {experts} experts do not split into {self._axis_words('ep')} "
                      f"({experts} % {mesh.ep} = {experts % mesh.ep}); ep must divide the expert count", "parallel.ep")
        if ffn % mesh.etp:
            self.fail(f"{mats[-1]}: an expert's width {ffn} does not split over {self._axis_words('etp')} "
                      f"({ffn} % {mesh.etp} = {ffn % mesh.etp})", "parallel.ep" if mesh.ep > 1 else None)
        outer = (Shard(0, (Segment(experts, 1),), "ep", mesh.expert_order),) if mesh.ep > 1 else ()
        axis = "etp" if mesh.ep > 1 else "world"
        width = (Segment(ffn, 1),)
        for name in mats[:-1]:
            rows = self.program.params[name].shape[1]
            inner = width * (rows // ffn)  # [gate | up] fused: two segments
            self._set(name, sharded(*outer, *((Shard(1, inner, axis),) if mesh.etp > 1 else ())))
        self._set(mats[-1], sharded(*outer, *((Shard(2, width, axis),) if mesh.etp > 1 else ())))
        if biases and mesh.etp > 1:  # a rank holding part of an expert's width would add its down bias again
            self.fail(f"{biases[-1]}: expert biases (gpt-oss) need whole experts on each rank, but "
                      f"{self._axis_words('etp')} split each expert's width; set ep to the number of ranks "
                      f"(tp x dp = {mesh.world})", "parallel.ep")
        for name in biases if outer else ():  # [experts, rows]: split with the experts
            self._set(name, sharded(*outer))

    # ------------------------------------------------------------ which projections are column-parallel
    def _column_plan(self) -> dict[str, list[_Seg]]:
        """Each linear whose output reaches attention heads (tensor-parallel attention) or a SwiGLU, with the
        segments of its output dim; checked against the mesh (an error names the weight and the numbers). None
        under data-parallel attention with dense MLPs replicated: each rank's rows go through whole weights."""
        plan = {}
        if self.mesh.attention == "dp" and self.mesh.dense == "replicated":
            return plan
        for vid, node in self.graph.items():
            if node.op not in LINEAR_OPS or self.graph.node(node.inputs[1]).op != "param":
                continue
            out = node.out
            segs = self._layout(vid, out.shape[-1])
            if segs is None:
                continue
            self._check_segments(node, segs)
            plan[vid] = segs
        return plan

    def _layout(self, vid: str, width: int) -> list[_Seg] | None:
        g = self.graph
        if vid in g.outputs:
            return None
        users = g.users(vid)
        slices = [u for u in users if g.node(u).op == "slice"]
        if slices:
            if len(slices) != len(users):
                return None
            spans = sorted((g.node(u).attrs["start"], g.node(u).attrs["stop"], u) for u in slices)
            if spans[0][0] != 0 or spans[-1][1] != width or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
                return None
            out: list[_Seg] = []
            for start, stop, u in spans:
                sub = self._layout(u, stop - start)
                if sub is None:
                    return None
                out.extend(sub)
            return out
        if len(users) != 1:
            return None
        user = g.node(users[0])
        if user.op == "view" and len(user.attrs["shape"]) == 2:
            role = self._head_sink(users[0])
            if role is None:
                return None
            heads, dim = user.attrs["shape"]
            return [_Seg(Segment(heads, dim), role == "KV heads", role)]
        if user.op == "silu_mul" and width % 2 == 0:
            return [_Seg(Segment(width // 2, 1), False, "FFN width")] * 2
        if user.op in (*GATED_ACTIVATIONS, "mul") and self._swiglu(users[0]):
            return [_Seg(Segment(width, 1), False, "FFN width")]
        return None

    def _swiglu(self, vid: str) -> bool:
        """`vid` (an activation, or the mul) belongs to a act(gate) * up whose product feeds a projection."""
        g = self.graph
        node = g.node(vid)
        if node.op in GATED_ACTIVATIONS:
            users = g.users(vid)
            return len(users) == 1 and g.node(users[0]).op == "mul" and self._swiglu(users[0])
        users = g.users(vid)
        return (vid not in g.outputs and len(users) == 1 and g.node(users[0]).op in LINEAR_OPS
                and g.node(users[0]).inputs[0] == vid)

    def _head_sink(self, vid: str) -> str | None:
        """What a [T, heads, dim] value reaches through rope / per-head norms / slices: "query heads" (attention
        q, MLA queries), "KV heads" (attention k, v), or None (anything else, or data-parallel attention)."""
        if self.mesh.attention != "tp":
            return None
        g = self.graph
        roles = set()
        stack = [vid]
        while stack:
            v = stack.pop()
            if v in g.outputs:
                return None
            for u in g.users(v):
                n = g.node(u)
                index = n.inputs.index(v)
                if n.op == "attention" and index < 3:
                    roles.add("query heads" if index == 0 else "KV heads")
                elif n.op == "mla_attention" and index < 2:
                    roles.add("query heads")
                elif n.op in _HEAD_THROUGH and index == 0 and isinstance(n.out, TensorType) and n.out.rank == 3:
                    stack.append(u)
                else:
                    return None
        return roles.pop() if len(roles) == 1 else None

    def _check_segments(self, node: Node, segs: list[_Seg]) -> None:
        n = self.mesh.world
        spec = self.program.params[self.graph.node(node.inputs[1]).attrs["name"]]
        for k, s in enumerate(segs):
            units = s.segment.units
            if units % n == 0 or (s.replicable and n % units == 0):
                continue
            tensor = spec.source[k] if len(spec.source) == len(segs) else ", ".join(spec.source) or spec.name
            what = f"{units} {s.role}" + (f" of {s.segment.size}" if s.segment.size > 1 else "")
            why = (f"{units} % {n} = {units % n}" + (f", and {n} % {units} = {n % units} so they cannot be replicated "
                                                     "either" if s.replicable else ""))
            hint = (" (KV heads split when tp divides them, and are replicated when they divide tp)"
                    if s.replicable else "")
            self.fail(f"{spec.name} ('{tensor}'): {what} do not split over {self._axis_words('world')}: {why}{hint}")

    def _dp_gathers(self) -> set[str]:
        """Data-parallel attention: the token-sharded rows an MLP reads (a column-parallel projection's input, a
        sharded MoE's), gathered once right where they are made so every reader of them reads all ranks' rows.
        With one rank per expert group (ep = tp x dp) a MoE's rows are not gathered for it: they stay on their
        ranks and its (token, expert) pairs travel to the experts' ranks (moe_experts_a2a) — unless another MLP
        (shared experts) gathers them anyway."""
        if self.mesh.attention != "dp":
            return set()
        a2a = self.mesh.etp == 1
        out = set()
        for vid, node in self.graph.items():
            if (node.op in LINEAR_OPS and vid in self.columns) or (node.op == "moe_experts" and not a2a):
                out.add(node.inputs[0])
        return out
