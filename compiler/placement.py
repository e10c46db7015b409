"""Where every value of a parallel program lives: its placement over the device mesh, the rules that derive a
node's placement from its inputs', and the per-rank (local) shapes and shards that follow.

The IR keeps global shapes (`models/*.dsl` are written once); a placement says how a global value is laid out
over the `world` ranks of the mesh:

    R                 replicated: every rank holds the whole value
    P                 partial: every rank holds a summand; the value is their sum (a row-parallel GEMM's output)
    S<dims>           sharded: on each listed dim, every rank holds its part (`Shard`)
    T                 token-sharded (data-parallel attention): each rank holds the rows of its own sequences
    L                 logit-row-sharded (data-parallel attention): each rank holds the logits rows of its sequences

A sharded dim is a concatenation of segments (a fused q/k/v output is [q | k | v]); a segment is `units` units
of `size` elements (heads of head_dim, experts, vocabulary rows), split over a mesh axis unit-wise: with
`units % n == 0` rank c holds units [c·units/n, (c+1)·units/n) (or, for experts placed round-robin, units c,
c + n, ...); with `n % units == 0` (fewer KV heads than ranks) unit c // (n / units) is replicated on n / units
ranks; `padded` > units pads the segment with zero units to a multiple of n (a vocabulary not divisible by tp).
Anything else is not a placement (`PlacementError`). Text form, as `--dump-ir` prints it (attribute
`placement`): `S1[4x16,2x16,2x16]` (dim 1, three segments), `S0[509x1/510]` (padded), `S0@ep~rr[8x1];2@etp[32x1]`.

The rules (`infer_placement`, one per op) are the verifier's: a node's recorded placement must be what its
inputs' give, and a partial value may reach only a reducing op (`all_reduce`, `dp_scatter`, `add` of two
partials, the partial operand of `all_reduce_add_rms_norm`). The pass that decides the placements is
`passes/place_parallel.py`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.compiler.ir import DTYPE_BYTES, Graph, Node, Program, TensorType, TupleType
from kiln.compiler.ops import attention_sinks, split_expert_inputs

AXES = ("world", "ep", "etp")  # all ranks; expert-parallel groups; tensor parallelism inside one expert group
EXPERT_ORDERS = ("contiguous", "round_robin")
# ops whose input may be partial, by input index: the reductions, and lora's base output (a row-parallel
# linear's partial sum, to which each rank adds its summand of the branch: sum_k (x_k A_k) B = (x A) B)
REDUCING_INPUTS: dict[str, tuple[int, ...]] = {"all_reduce": (0,), "dp_scatter": (0,), "add": (0, 1),
                                                "all_reduce_add_rms_norm": (0,), "lora": (1,)}
COLLECTIVE_OPS = ("all_reduce", "all_gather", "gather_logits", "dp_gather", "dp_scatter", "all_reduce_add_rms_norm",
                  "moe_experts_a2a")


class PlacementError(Exception):
    """A value has no placement its inputs allow (the verifier's placement rule), or a shape does not split."""


# ---------------------------------------------------------------- the mesh


@dataclass(frozen=True, slots=True)
class Mesh:
    """The device mesh of a recipe's `parallel { tp; dp; ep }`: `world` = tp · dp ranks on one axis.

    Attention is tensor-parallel over the world (`attention == "tp"`, heads sharded) or, with dp > 1, data-
    parallel (`"dp"`: each rank its own sequences, attention weights replicated). MLPs are sharded over the
    world either way: a dense FFN by its width, experts by `ep` groups of whole experts (`expert_order`
    contiguous or round-robin) and, inside a group, by their width over `etp` = world / ep ranks — except,
    under data-parallel attention with `dense == "replicated"`, the dense MLPs (a MoE's shared experts too):
    each rank holds them whole and computes only its own rows. Rank r is (ep group r // etp, position r % etp).
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    expert_order: str = "contiguous"
    dense: str = "sharded"

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def etp(self) -> int:
        return self.world // self.ep

    @property
    def attention(self) -> str:
        return "dp" if self.dp > 1 else "tp"

    def axis_size(self, axis: str) -> int:
        return {"world": self.world, "ep": self.ep, "etp": self.etp}[axis]

    def coord(self, axis: str, rank: int) -> int:
        return {"world": rank, "ep": rank // self.etp, "etp": rank % self.etp}[axis]

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world, "tp": self.tp, "dp": self.dp, "ep": self.ep, "etp": self.etp,
                "attention": self.attention, "expert_placement": self.expert_order,
                **({"dense": self.dense} if self.dense != "sharded" else {})}


def mesh_of(program: Program) -> Mesh:
    """The mesh of a program's recipe options (a single device when the recipe has no `parallel` section)."""
    from kiln.compiler.options import RecipeOptions

    par = RecipeOptions.from_meta(program.meta).parallel
    return Mesh(par.tp, par.dp, par.ep, par.expert_placement, par.dense)


# ---------------------------------------------------------------- placements


@dataclass(frozen=True, slots=True)
class Segment:
    units: int
    size: int
    padded: int = 0  # units after zero padding (0: none)

    @property
    def total_units(self) -> int:
        return self.padded or self.units

    def __str__(self) -> str:
        return f"{self.units}x{self.size}" + (f"/{self.padded}" if self.padded else "")


@dataclass(frozen=True, slots=True)
class Shard:
    """Dim `dim` split over mesh axis `axis`, segment by segment."""

    dim: int
    segments: tuple[Segment, ...]
    axis: str = "world"
    order: str = "contiguous"

    def __str__(self) -> str:
        return (f"{self.dim}" + ("" if self.axis == "world" else f"@{self.axis}")
                + ("~rr" if self.order == "round_robin" else "") + "[" + ",".join(map(str, self.segments)) + "]")


@dataclass(frozen=True, slots=True)
class Placement:
    kind: str  # R P S T L, or "tuple"
    shards: tuple[Shard, ...] = ()
    items: tuple[Placement, ...] = ()  # kind "tuple": one per element of a tuple-valued op

    def __str__(self) -> str:
        if self.kind == "tuple":
            return "(" + ", ".join(map(str, self.items)) + ")"
        if self.kind == "S":
            return "S" + ";".join(map(str, self.shards))
        return self.kind

    def shard(self, dim: int) -> Shard | None:
        return next((s for s in self.shards if s.dim == dim), None)

    @property
    def is_partial(self) -> bool:
        return self.kind == "P" or (self.kind == "tuple" and any(i.is_partial for i in self.items))


R, P, T, L = Placement("R"), Placement("P"), Placement("T"), Placement("L")
_SHARD = re.compile(r"(\d+)(?:@(\w+))?(~rr)?\[([^\]]*)\]")


def sharded(*shards: Shard) -> Placement:
    return Placement("S", tuple(sorted(shards, key=lambda s: s.dim)))


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text.startswith("("):
        inner = text[1:-1]
        return Placement("tuple", items=tuple(parse_placement(p) for p in _split_top(inner)))
    if text in ("R", "P", "T", "L"):
        return Placement(text)
    if not text.startswith("S"):
        raise PlacementError(f"not a placement: {text!r}")
    shards = []
    for part in text[1:].split(";"):
        m = _SHARD.fullmatch(part)
        if m is None:
            raise PlacementError(f"not a shard: {part!r} in {text!r}")
        segs = []
        for s in m.group(4).split(","):
            units, _, rest = s.partition("x")
            size, _, padded = rest.partition("/")
            segs.append(Segment(int(units), int(size), int(padded or 0)))
        shards.append(Shard(int(m.group(1)), tuple(segs), m.group(2) or "world",
                            "round_robin" if m.group(3) else "contiguous"))
    return sharded(*shards)


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch in "(["
        depth -= ch in ")]"
        cur += ch
    return [p for p in (*parts, cur) if p.strip()]


def placement_of(node: Node) -> Placement | None:
    p = node.attrs.get("placement")
    return parse_placement(p) if isinstance(p, str) else None


# ---------------------------------------------------------------- splitting a segment over an axis


def split_ok(seg: Segment, n: int) -> bool:
    return seg.total_units % n == 0 or n % seg.total_units == 0


def local_units(seg: Segment, n: int) -> int:
    if seg.total_units % n == 0:
        return seg.total_units // n
    if n % seg.total_units == 0:
        return 1
    raise PlacementError(f"{seg.units} units do not split over {n} ranks")


def units_of(seg: Segment, n: int, c: int, order: str = "contiguous") -> list[int]:
    """The global unit indices rank coordinate `c` of `n` holds, in local order (indices >= units: padding)."""
    k = local_units(seg, n)
    if seg.total_units % n:  # replicated units
        return [c // (n // seg.total_units)]
    if order == "round_robin":
        return [c + j * n for j in range(k)]
    return list(range(c * k, (c + 1) * k))


def local_dim(shard: Shard, mesh: Mesh) -> int:
    n = mesh.axis_size(shard.axis)
    return sum(local_units(s, n) * s.size for s in shard.segments)


def local_slice(shard: Shard, start: int, stop: int, mesh: Mesh) -> tuple[int, int]:
    """Where the global slice [start, stop) of a dim sharded as `shard` (whole segments) lies in a rank's part."""
    n = mesh.axis_size(shard.axis)
    offset, lstart, lstop = 0, None, None
    for (a, b), seg in zip(segment_ranges(shard), shard.segments, strict=True):
        if a == start:
            lstart = offset
        offset += local_units(seg, n) * seg.size
        if b == stop:
            lstop = offset
    if lstart is None or lstop is None:
        raise PlacementError(f"slice [{start}:{stop}] cuts across the segments of {shard}")
    return lstart, lstop


def local_shape(shape: tuple, placement: Placement | None, mesh: Mesh) -> tuple:
    """The shape one rank holds of a value of global `shape` (symbolic dims unchanged)."""
    if placement is None or placement.kind != "S":
        return tuple(shape)
    out = list(shape)
    for shard in placement.shards:
        out[shard.dim] = local_dim(shard, mesh)
    return tuple(out)


def local_type(t: TensorType | TupleType | None, placement: Placement | None, mesh: Mesh):
    if t is None or placement is None:
        return t
    if isinstance(t, TupleType):
        return TupleType(tuple(local_type(x, p, mesh) for x, p in zip(t.items, placement.items, strict=True)))
    return TensorType(local_shape(t.shape, placement, mesh), t.dtype)


def shard_tensor(t: Any, placement: Placement | None, mesh: Mesh, rank: int) -> Any:
    """Rank `rank`'s part of the global tensor `t` (torch): each sharded dim cut segment by segment, zero rows
    where a segment is padded."""
    import torch

    if placement is None or placement.kind != "S":
        return t
    for shard in placement.shards:
        n, c = mesh.axis_size(shard.axis), mesh.coord(shard.axis, rank)
        parts, start = [], 0
        for seg in shard.segments:
            block = t.narrow(shard.dim, start, seg.units * seg.size)
            start += seg.units * seg.size
            units = block.unflatten(shard.dim, (seg.units, seg.size))
            wanted = units_of(seg, n, c, shard.order)
            real = [u for u in wanted if u < seg.units]
            picked = units.index_select(shard.dim, torch.tensor(real, dtype=torch.long))
            if len(real) < len(wanted):  # padding units: zeros
                pad_shape = list(picked.shape)
                pad_shape[shard.dim] = len(wanted) - len(real)
                picked = torch.cat((picked, picked.new_zeros(pad_shape)), dim=shard.dim)
            parts.append(picked.flatten(shard.dim, shard.dim + 1))
        t = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
    return t.contiguous()


def shard_runs(shard: Shard, mesh: Mesh) -> list[list[tuple[int, int]]]:
    """For each rank, the global indices of a dim sharded as `shard` (no padding) that the rank holds, in its
    local order, as [start, stop) runs (a segment's replicated or contiguous units: one run per segment)."""
    out = []
    n = mesh.axis_size(shard.axis)
    for rank in range(mesh.world):
        c, runs, start = mesh.coord(shard.axis, rank), [], 0
        for seg in shard.segments:
            if seg.padded:
                raise PlacementError(f"a padded segment ({seg}) has rows no global index holds")
            for u in units_of(seg, n, c, shard.order):
                a = start + u * seg.size
                if runs and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], a + seg.size)
                else:
                    runs.append((a, a + seg.size))
            start += seg.units * seg.size
        out.append(runs)
    return out


def lora_shard(graph: Graph, node: Node, mesh: Mesh) -> dict[str, Any] | None:
    """How a placed `lora` node's adapter weights split over the ranks (the manifest's `lora.targets[].shard`):
    column-parallel -> {"dim": 0, ...}, each rank's rows of the [N, K] delta (B's rows); row-parallel ->
    {"dim": 1, ...}, each rank's input columns (A's columns); `ranges`: each rank's [start, stop) runs of that
    dim. None when the branch is whole on every rank."""
    p = placement_of(node)
    if p is None or p.kind in ("R", "T"):
        return None
    x = graph.node(node.inputs[0])
    last = x.out.rank - 1
    if p.kind == "S":
        dim, shard = 0, p.shard(last)
    else:  # P: the input is sharded on its last dim
        dim, shard = 1, placement_of(x).shard(last)
    return {"dim": dim, "ranges": [[list(r) for r in runs] for runs in shard_runs(shard, mesh)]}


def lora_local_rows(graph: Graph, node: Node, mesh: Mesh) -> tuple[int, ...]:
    """Each adapted module's output rows on one rank (every rank holds as many): a column-parallel branch's
    share of each module's rows; the whole rows otherwise."""
    rows = tuple(int(r) for r in node.attrs["rows"])
    shard = lora_shard(graph, node, mesh)
    if shard is None or shard["dim"] != 0:
        return rows
    out, start = [], 0
    for n in rows:
        out.append(sum(max(0, min(b, start + n) - max(a, start)) for a, b in shard["ranges"][0]))
        start += n
    return tuple(out)


# ---------------------------------------------------------------- the rules


def _same(ins: list[Placement], what: str) -> Placement:
    first = ins[0]
    for p in ins[1:]:
        if p != first:
            raise PlacementError(f"{what} operands are placed differently: {', '.join(map(str, ins))}")
    return first


def _rowwise(x: Placement, rank: int, what: str, *, last_ok: bool = False) -> Placement:
    """Ops that work along the last dim, row by row: replicated/token rows keep theirs; a shard on another dim is
    kept; a shard on the last dim only where the op works element by element (`last_ok`)."""
    if x.kind == "S" and not last_ok and x.shard(rank - 1) is not None:
        raise PlacementError(f"{what} reduces over the last dim, which is sharded ({x})")
    return x


def _not_partial(ins: list[Placement], op: str) -> None:
    for k, p in enumerate(ins):
        if p.is_partial and k not in REDUCING_INPUTS.get(op, ()):
            raise PlacementError(f"partial (unreduced) input {k} ({p}) reaches {op}, which does not reduce it; an "
                                 "all_reduce (or dp_scatter) must come first")


def _rank(t: Any) -> int:
    return t.rank if isinstance(t, TensorType) else 0


def infer_placement(node: Node, ins: list[Placement], in_types: list[Any]) -> Placement:
    """The placement `node` has given its inputs' placements (PlacementError when they do not fit its op)."""
    op = node.op
    _not_partial(ins, op)
    rule = _RULES.get(op)
    if rule is None:
        if all(p.kind == "R" for p in ins):
            return R
        raise PlacementError(f"{op} has no placement rule for sharded inputs ({', '.join(map(str, ins))})")
    return rule(node, ins, in_types)


def _embedding(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    ids, table = ins
    if table.kind == "R":
        return ids
    vocab = table.shard(0)
    if ids.kind != "R" or vocab is None or len(table.shards) != 1:
        raise PlacementError(f"a vocab-parallel embedding reads replicated ids and a table sharded on dim 0, got "
                             f"{ids}, {table}")
    return P  # masked lookup: each rank's rows, zeros elsewhere


def _rms_norm(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    if ins[1].kind != "R":
        raise PlacementError(f"rms_norm weight must be replicated, got {ins[1]}")
    return _rowwise(ins[0], _rank(t[0]), "rms_norm")


def _add_rms_norm(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x = _same(ins[:2], "add_rms_norm")
    if ins[2].kind != "R" or x.kind not in ("R", "T"):
        raise PlacementError(f"add_rms_norm takes replicated (or token-sharded) rows and weight, got "
                             f"{', '.join(map(str, ins))}")
    return Placement("tuple", items=(x, x))


def _all_reduce_add_rms_norm(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    if ins[0].kind != "P" or ins[1].kind != "R" or ins[2].kind != "R":
        raise PlacementError(f"all_reduce_add_rms_norm takes a partial value, a replicated residual and weight, got "
                             f"{', '.join(map(str, ins))}")
    return Placement("tuple", items=(R, R))


def _linear(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    last = _rank(t[0]) - 1
    if w.kind == "R":
        if bias is not None and bias.kind != "R":
            raise PlacementError(f"linear with a replicated weight takes a replicated bias, got {bias}")
        return _rowwise(x, last + 1, "linear")
    col, row = w.shard(0), w.shard(1)
    if col is not None and row is None and x.kind == "R":  # column-parallel
        if bias is not None and bias != sharded(Shard(0, col.segments, col.axis, col.order)):
            raise PlacementError(f"a column-parallel linear's bias must be sharded as its weight's rows, got {bias}")
        return sharded(Shard(last, col.segments, col.axis, col.order))
    xs = x.shard(last) if x.kind == "S" else None
    if row is not None and col is None and xs is not None and len(x.shards) == 1:  # row-parallel
        if (xs.segments, xs.axis) != (row.segments, row.axis):
            raise PlacementError(f"a row-parallel linear's weight columns {w} must be sharded as its input {x}")
        if bias is not None:
            raise PlacementError("a row-parallel linear adds its bias after the all_reduce, not in each rank's sum")
        return P
    raise PlacementError(f"linear: input {x} and weight {w} are neither column- nor row-parallel")


# ---------------------------------------------------------------- quantized linears
#
# A quantized GEMM (`linear_fp8`, `linear_w4a16`) reads its [N, K] weight through several params in their
# published layouts. Tensor parallelism places the *logical* weight exactly as a float one (column-parallel:
# S0 by output segments; row-parallel: S1 as its input), and each param follows from that: e4m3 weights as
# the float weight; per-channel scales with N; per-tensor and input scales replicated; 128x128 block scales by
# blocks of N (column) or K (row); AWQ/GPTQ packed int32 words by 8 columns/rows, group scales and zeros by
# groups of K. GPTQ's g_idx holds global group numbers (act-order permutes them), so a row-parallel GPTQ
# weight keeps its scales and zeros whole on every rank (a few % of the weight's bytes) and slices g_idx.

LINEAR_OPS = ("linear", "linear_fp8", "linear_w4a16")


def linear_weight_params(node: Node) -> int:
    """How many weight params a linear-family node reads after x (its bias, if any, comes next)."""
    if node.op == "linear_fp8":
        return 3 if node.attrs.get("act") == "static_per_tensor" else 2
    if node.op == "linear_w4a16":
        return 4 if node.attrs["format"] == "gptq" else 3
    return 1


def regroup(segments: tuple[Segment, ...], factor: int, what: str) -> tuple[Segment, ...]:
    """The segments of a dim whose every `factor` consecutive elements became one (a packed int32 word of 8
    int4 values, a scale per group or block): the fewest `t` whole units that pack into whole elements
    (t = factor / gcd(size, factor)) become one unit of t·size / factor, so a rank holding a multiple of t
    units holds exactly its packed elements (4 heads of 24 rows in 16-row blocks: 2 units of 3 blocks)."""
    out = []
    for seg in segments:
        if seg.padded:
            raise PlacementError(f"{what}: a padded segment ({seg}) cannot be packed by {factor}")
        t = factor // math.gcd(seg.size, factor)
        if seg.units % t:
            raise PlacementError(f"{what}: {seg.units} units of {seg.size} do not pack by {factor}")
        out.append(Segment(seg.units // t, t * seg.size // factor))
    return tuple(out)


def quantized_param_placements(node: Node, logical: Placement) -> tuple[Placement, ...]:
    """The placements of a quantized linear's weight params (inputs 1..), given the placement `logical` its
    [N, K] float weight would have (R, S0 column-parallel or S1 row-parallel); PlacementError when a shard
    boundary cuts a packed word, a group or a block."""
    n_params = linear_weight_params(node)
    if logical.kind == "R":
        return (R,) * n_params
    col, row = logical.shard(0), logical.shard(1)
    shard = col or row
    like = lambda dim, segs: sharded(Shard(dim, segs, shard.axis, shard.order))  # noqa: E731
    a = node.attrs
    if node.op == "linear_fp8":
        gran, block = a.get("granularity", "tensor"), a.get("block", 0)
        if gran == "tensor":
            scale = R
        elif gran == "channel":
            scale = like(0, col.segments) if col else R
        else:
            scale = like(0 if col else 1, regroup(shard.segments, block, f"fp8 {block}x{block} block scales"))
        return (logical, scale, *((R,) if n_params == 3 else ()))
    group = a["group"]
    if a["format"] == "awq":  # qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]
        if col:
            packed = like(1, regroup(col.segments, 8, "awq packs 8 output columns per int32"))
            return packed, packed, like(1, col.segments)
        grouped = like(0, regroup(row.segments, group, f"awq group={group}"))
        return like(0, row.segments), grouped, grouped
    # gptq: qweight [K/8, N], qzeros [K/g, N/8], scales [K/g, N], g_idx [K]
    if col:
        return (like(1, col.segments), like(1, regroup(col.segments, 8, "gptq packs 8 zeros per int32")),
                like(1, col.segments), R)
    return like(0, regroup(row.segments, 8, "gptq packs 8 input rows per int32")), R, R, like(0, row.segments)


def logical_weight_placement(node: Node, params: list[Placement]) -> Placement:
    """The [N, K] weight placement a quantized linear's params encode (the inverse of
    quantized_param_placements, read off the param that keeps N or K unpacked)."""
    if node.op == "linear_fp8":
        return params[0]
    scales = params[2]
    if scales.kind == "S" and scales.shard(1) is not None:
        s = scales.shard(1)
        return sharded(Shard(0, s.segments, s.axis, s.order))
    rows = params[0] if node.attrs["format"] == "awq" else params[3]
    if rows.kind == "S" and rows.shard(0) is not None:
        s = rows.shard(0)
        return sharded(Shard(1, s.segments, s.axis, s.order))
    return R


def _quantized_linear(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    n_params = linear_weight_params(node)
    params = ins[1:1 + n_params]
    logical = logical_weight_placement(node, params)
    want = quantized_param_placements(node, logical)
    if tuple(params) != want:
        raise PlacementError(f"{node.op}: weight params placed {', '.join(map(str, params))}, but a weight placed "
                             f"{logical} needs {', '.join(map(str, want))}")
    return _linear(node, [ins[0], logical, *ins[1 + n_params:]], [t[0], None, *t[1 + n_params:]])


def _lora(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    """lora(x, y): y plus x's low-rank branch, placed as its linear's output y. Column-parallel (x whole, y's
    output rows sharded): each rank's A is whole and its B holds the rank's rows of y. Row-parallel (x sharded on
    its last dim, y partial): each rank's A holds the rank's input columns and B is whole; the rank adds
    (x_k A_k) B to its partial sum, and the base's reduction sums the branch too, exactly."""
    x, y = ins
    last = _rank(t[0]) - 1
    if x == y and x.kind in ("R", "T"):
        return y
    if x.kind == "R" and y.kind == "S" and len(y.shards) == 1 and y.shards[0].dim == last:
        return y
    xs = x.shard(last) if x.kind == "S" else None
    if y.kind == "P" and xs is not None and len(x.shards) == 1:
        return P
    raise PlacementError(f"lora reads its linear's input and output, column-parallel (R, S on the last dim) or "
                         f"row-parallel (S on the last dim, P), got {x}, {y}")


def _view(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    (x,) = ins
    last = _rank(t[0]) - 1
    if x.kind != "S" or x.shard(last) is None:
        return x
    shard = x.shard(last)
    shape = tuple(node.attrs["shape"])
    if len(shape) != 2 or len(shard.segments) != 1 or shard.segments[0].size % shape[1]:
        raise PlacementError(f"view{list(shape)} of a value sharded as {x} on its last dim does not keep whole units")
    seg = shard.segments[0]
    new = Shard(last, (Segment(seg.units, seg.size // shape[1], seg.padded),), shard.axis, shard.order)
    return sharded(*(s for s in x.shards if s.dim != last), new)


def segment_ranges(shard: Shard) -> list[tuple[int, int]]:
    """[start, stop) of each segment along the global dim."""
    out, start = [], 0
    for seg in shard.segments:
        out.append((start, start + seg.units * seg.size))
        start += seg.units * seg.size
    return out


def _slice(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    (x,) = ins
    last = _rank(t[0]) - 1
    if x.kind != "S" or x.shard(last) is None:
        return x
    shard = x.shard(last)
    ranges = segment_ranges(shard)
    start, stop = node.attrs["start"], node.attrs["stop"]
    first = next((k for k, (a, _) in enumerate(ranges) if a == start), None)
    end = next((k for k, (_, b) in enumerate(ranges) if b == stop), None)
    if first is None or end is None or end < first:
        raise PlacementError(f"slice [{start}:{stop}] cuts across the segments of {x}")
    return sharded(*(s for s in x.shards if s.dim != last),
                   Shard(last, shard.segments[first:end + 1], shard.axis, shard.order))


def _heads(x: Placement, what: str) -> Shard | None:
    if x.kind != "S":
        return None
    if len(x.shards) != 1 or x.shards[0].dim != 1:
        raise PlacementError(f"{what} must be sharded on its heads dim (1) only, got {x}")
    return x.shards[0]


def _rope(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    _heads(ins[0], "rope input")
    return ins[0]


def _attention(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    q, k, v = ins[:3]
    if k != v:
        raise PlacementError(f"attention k and v are placed differently: {k}, {v}")
    qh, kh = _heads(q, "attention q"), _heads(k, "attention k")
    if qh is None and kh is None:
        return _same([q, k, v], "attention")
    if qh is None or kh is None or len(qh.segments) != 1 or len(kh.segments) != 1:
        raise PlacementError(f"attention q and k/v must both be sharded by heads, got {q}, {k}")
    sinks = attention_sinks(len(ins), node.attrs)
    if sinks is not None and ins[sinks] != sharded(Shard(0, qh.segments, qh.axis)):  # one logit per query head
        raise PlacementError(f"attention sinks must be sharded as the query heads ({q}), got {ins[sinks]}")
    for scale in ins[3:5] if node.attrs.get("kv_dtype") else ():  # per-KV-head fp8 scales follow the KV heads
        if scale != sharded(Shard(0, kh.segments, kh.axis)):
            raise PlacementError(f"attention KV scales must be sharded as the KV heads ({k}), got {scale}")
    head_dim = t[0].shape[2]
    return sharded(Shard(1, (Segment(qh.segments[0].units, head_dim),), qh.axis))


def _mla_attention(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    q_nope, q_pe, c_kv, k_pe, w_kv_b = ins[:5]
    if q_nope != q_pe or c_kv != k_pe:
        raise PlacementError(f"mla_attention q_nope/q_pe and c_kv/k_pe are placed differently: "
                             f"{', '.join(map(str, ins))}")
    qh = _heads(q_nope, "mla_attention q")
    if qh is None:
        if w_kv_b.kind != "R" or c_kv != q_nope:
            raise PlacementError(f"mla_attention over replicated heads takes replicated weights, got "
                                 f"{', '.join(map(str, ins))}")
        return q_nope
    heads = qh.segments[0].units
    dv = t[4].shape[0] // heads - t[0].shape[2]
    want = sharded(Shard(0, (Segment(heads, t[0].shape[2] + dv),), qh.axis))
    if c_kv.kind != "R" or w_kv_b != want or any(s.kind != "R" for s in ins[5:]):
        raise PlacementError(f"mla_attention with heads sharded as {q_nope} reads the replicated latent and w_kv_b "
                             f"sharded as {want}, got {', '.join(map(str, ins))}")
    return sharded(Shard(1, (Segment(heads, dv),), qh.axis))


def _elementwise(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    if node.op == "add" and all(p.kind == "P" for p in ins):
        return P  # a sum of partial sums
    return _same(ins, node.op)


def _bias_add(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x, b = ins
    if b != R or x.kind not in ("R", "T"):
        raise PlacementError(f"bias_add adds a replicated bias to whole rows (replicated or token-sharded), got "
                             f"{x} + {b}")
    return x


def _lastwise(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    return _rowwise(ins[0], _rank(t[0]), node.op)


def _silu_mul(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    (x,) = ins
    last = _rank(t[0]) - 1
    shard = x.shard(last) if x.kind == "S" else None
    if shard is None:
        return x
    if len(shard.segments) != 2 or shard.segments[0] != shard.segments[1]:
        raise PlacementError(f"silu_mul splits [gate | up] in halves; its input must be sharded as two equal "
                             f"segments, got {x}")
    return sharded(*(s for s in x.shards if s.dim != last), Shard(last, shard.segments[:1], shard.axis))


def _concat(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x = _same(ins, "concat")
    return _rowwise(x, _rank(t[0]), "concat")


def _logits(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x, w = ins
    if w.kind == "R":
        if x.kind == "T":
            return L
        return _rowwise(x, _rank(t[0]), "logits")
    vocab = w.shard(0)
    if x.kind != "R" or vocab is None or len(w.shards) != 1:
        raise PlacementError(f"vocab-parallel logits read replicated rows and a weight sharded on dim 0, got {x}, {w}")
    return sharded(Shard(1, vocab.segments, vocab.axis))


def _router(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x = ins[0]
    if x.kind not in ("R", "T") or any(p.kind != "R" for p in ins[1:]):
        raise PlacementError(f"a router reads replicated (or token-sharded) logits, got {', '.join(map(str, ins))}")
    return Placement("tuple", items=(x, x))


def _moe_experts(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x, weights, ids, *rest = ins
    mats, biases = split_expert_inputs(rest, t[3:])
    if not (x == weights == ids) or x.kind not in ("R", "T"):
        raise PlacementError(f"moe_experts reads its rows, routing weights and ids placed alike, got "
                             f"{x}, {weights}, {ids}")
    if all(m.kind == "R" for m in rest):
        return x
    if biases:  # whole experts per rank only: a rank holding part of an expert's width would add b_down again
        down = mats[-1]
        if down.shard(2) is not None or any(b != sharded(*(s for s in down.shards if s.dim == 0)) for b in biases):
            raise PlacementError(f"expert biases must be split with whole experts ({down}), got "
                                 f"{', '.join(map(str, biases))}")
    if x.kind != "R":
        raise PlacementError("sharded experts read every rank's rows: gather the token-sharded rows first")
    down = mats[-1]
    experts = down.shard(0)
    ffn = down.shard(2)
    for m in mats[:-1]:
        if m.shard(0) != experts:
            raise PlacementError(f"expert weights split their experts differently: {', '.join(map(str, mats))}")
        inner = m.shard(1)
        if (inner is None) != (ffn is None) or (ffn is not None and {s for s in inner.segments} != set(ffn.segments)):
            raise PlacementError(f"expert gate/up and down split their width differently: {', '.join(map(str, mats))}")
    return P


def _moe_experts_a2a(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x, weights, ids, *mats = ins
    if not (x == weights == ids == T):
        raise PlacementError(f"moe_experts_a2a reads token-sharded rows, weights and ids, got {x}, {weights}, {ids}")
    for m in mats:
        if len(m.shards) != 1 or m.shards[0].dim != 0 or m.shards[0].axis != "ep":
            raise PlacementError(f"moe_experts_a2a reads whole experts split over ep groups of one rank, got {m}")
    return T


def _reduction(result: Placement):
    """The rule of a collective that reduces a partial value to `result` (all_reduce: R, dp_scatter: T)."""
    def rule(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
        if ins[0].kind != "P":
            raise PlacementError(f"{node.op} reads a partial value, got {ins[0]}")
        return result

    return rule


def _all_gather(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    x = ins[0]
    dim = node.attrs["dim"]
    if x.kind != "S" or len(x.shards) != 1 or x.shards[0].dim != dim:
        raise PlacementError(f"{node.op}(dim={dim}) reads a value sharded on dim {dim} only, got {x}")
    return R


def _dp_gather(node: Node, ins: list[Placement], t: list[Any]) -> Placement:
    want = "L" if node.attrs.get("rows") == "logits" else "T"
    if ins[0].kind != want:
        raise PlacementError(f"dp_gather(rows={node.attrs.get('rows')}) reads a {want}-placed value, got {ins[0]}")
    return R


_RULES = {
    "embedding": _embedding, "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm,
    "all_reduce_add_rms_norm": _all_reduce_add_rms_norm, "linear": _linear,
    "linear_fp8": _quantized_linear, "linear_w4a16": _quantized_linear, "view": _view, "slice": _slice,
    "rope": _rope, "attention": _attention, "mla_attention": _mla_attention, "silu": _elementwise,
    "gelu_tanh": _elementwise, "softcap": _elementwise, "scale": _elementwise,  # value by value: keep theirs
    "mul": _elementwise, "add": _elementwise, "bias_add": _bias_add, "deinterleave": _lastwise, "silu_mul": _silu_mul, "concat": _concat,
    "logits": _logits, "moe_topk_softmax": _router, "moe_topk_grouped": _router, "moe_experts": _moe_experts,
    "moe_experts_a2a": _moe_experts_a2a, "lora": _lora,
    "all_reduce": _reduction(R), "all_gather": _all_gather, "gather_logits": _all_gather, "dp_gather": _dp_gather,
    "dp_scatter": _reduction(T),
    "block": lambda node, ins, t: ins[0],  # check_placements holds it to the block graph's own placements
    "getitem": lambda node, ins, t: ins[0].items[node.attrs["index"]] if ins[0].kind == "tuple" else ins[0],
}


# ---------------------------------------------------------------- the verifier's rule


def check_placements(program: Program) -> None:
    """Every node of a placed program (one whose nodes carry `placement`) has one, equal to what its op's rule
    gives its inputs'; a param node's is its ParamSpec's `sharding`; a block's input and output are placed as
    its call site; every segment splits over the mesh. Raises PlacementError naming the graph and value."""
    placed = any(placement_of(n) is not None for g in program.graphs.values() for _, n in g.items())
    if not placed:
        return
    mesh = mesh_of(program)
    for name, graph in program.graphs.items():
        for vid, node in graph.items():
            where = f"graph {name!r}: %{vid} = {node.op}"
            p = placement_of(node)
            if p is None:
                raise PlacementError(f"{where} has no placement (every value of a parallel program has one)")
            _check_splits(p, mesh, where)
            if node.op == "input":
                continue
            if node.op == "param":
                spec = program.params[node.attrs["name"]]
                want = parse_placement(spec.sharding["placement"]) if spec.sharding else R
                if p != want:
                    raise PlacementError(f"{where} is placed {p}, but param {spec.name!r} is sharded as {want}")
                continue
            ins = [placement_of(graph.node(i)) for i in node.inputs]
            if node.op == "block":
                block_graph = program.graphs[program.blocks[node.attrs["block"]].graph]
                arg = placement_of(block_graph.node(block_graph.inputs[0]))
                out = placement_of(block_graph.node(block_graph.outputs[0]))
                if ins[0] != arg or out != arg:
                    raise PlacementError(f"{where}: block {node.attrs['block']!r} takes {arg} and returns {out}; its "
                                         f"call passes {ins[0]} (a block's output is the next layer's input)")
                want = out
            else:
                try:
                    want = infer_placement(node, ins, [graph.node(i).out for i in node.inputs])
                except PlacementError as e:
                    raise PlacementError(f"{where}: {e}") from None
            if p != want:
                raise PlacementError(f"{where} is placed {p}, but its inputs ({', '.join(map(str, ins))}) give {want}")
        for out in graph.outputs:
            p = placement_of(graph.node(out))
            if p.is_partial:
                raise PlacementError(f"graph {name!r} returns partial %{out}: reduce it first")


def _check_splits(p: Placement, mesh: Mesh, where: str) -> None:
    for item in (p.items if p.kind == "tuple" else (p,)):
        for shard in item.shards:
            n = mesh.axis_size(shard.axis)
            for seg in shard.segments:
                if not split_ok(seg, n):
                    raise PlacementError(f"{where}: {seg.units} units of {seg.size} do not split over {n} ranks "
                                         f"({shard.axis})")


# ---------------------------------------------------------------- what a rank holds and sends


def param_placement(program: Program, name: str) -> Placement:
    spec = program.params[name]
    return parse_placement(spec.sharding["placement"]) if spec.sharding else R


def rank_param_bytes(program: Program, mesh: Mesh) -> int:
    """Bytes of the weights one rank holds (all ranks hold alike)."""
    total = 0
    for spec in program.params.values():
        layers = program.blocks[spec.block].count if spec.block else 1
        shape = local_shape(spec.shape, param_placement(program, spec.name), mesh)
        total += math.prod(shape) * DTYPE_BYTES[spec.dtype] * layers
    return total


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of the layer schedule: where, what, and the bytes per token (or per logits row) it moves."""

    graph: str
    value: str
    op: str
    count: int  # calls per step (a block's layers)
    bytes_per_token: int  # of the tensor each rank contributes (all_gather: the gathered whole)
    per: str = "token"  # token | row (logits rows) | step

    def wire_bytes(self, mesh: Mesh) -> float:
        """Bytes each rank sends per token with ring algorithms: all-reduce 2(n-1)/n of the tensor, gather and
        reduce-scatter (n-1)/n."""
        n = mesh.world
        factor = 2 * (n - 1) / n if self.op in ("all_reduce", "all_reduce_add_rms_norm") else (n - 1) / n
        return factor * self.bytes_per_token

    def to_json(self) -> dict[str, Any]:
        return {"graph": self.graph, "value": self.value, "op": self.op, "count": self.count,
                "bytes_per_token": self.bytes_per_token, "per": self.per}


def collectives(program: Program) -> list[Collective]:
    """Every collective node of the layer schedule, in graph order (forwards, then blocks)."""
    reps = {**dict.fromkeys(program.forward_graphs(), 1), **{b.graph: b.count for b in program.blocks.values()}}
    out = []
    for gname, graph in program.graphs.items():
        if gname not in reps:
            continue
        for vid, node in graph.items():
            if node.op not in COLLECTIVE_OPS:
                continue
            t = graph.node(node.inputs[0]).out
            per_row = math.prod(d for d in t.shape if isinstance(d, int)) * DTYPE_BYTES.get(t.dtype, 4)
            if node.op in ("all_gather", "gather_logits"):  # the most it moves: every logit
                per_row = math.prod(d for d in node.out.shape if isinstance(d, int)) * DTYPE_BYTES.get(t.dtype, 4)
            elif node.op == "moe_experts_a2a":  # each of a token's top_k rows there and back
                per_row *= 2 * graph.node(node.inputs[2]).out.shape[-1]
            logits_rows = graph.node(node.inputs[0]).op == "logits"
            per = "row" if node.op in ("all_gather", "gather_logits", "dp_gather") and logits_rows else "token"
            out.append(Collective(gname, vid, node.op, reps[gname], per_row, per))
    return out


def graph_placements(graph: Graph) -> Mapping[str, Placement | None]:
    return {vid: placement_of(n) for vid, n in graph.items()}


@dataclass
class PlacementTable:
    """Placements of a program's values, for codegen: `of(graph, vid)`."""

    program: Program
    mesh: Mesh = field(init=False)

    def __post_init__(self) -> None:
        self.mesh = mesh_of(self.program)

    @property
    def parallel(self) -> bool:
        return self.mesh.world > 1

    def of(self, graph: Graph, vid: str) -> Placement | None:
        return placement_of(graph.node(vid))

    def local(self, graph: Graph, vid: str):
        return local_type(graph.node(vid).out, self.of(graph, vid), self.mesh)


def local_kv_layout(program: Program):
    """The KV geometry one rank allocates (compiler/kv_layout.py's, with the rank's KV heads: sharded or
    replicated ones); the whole layout on a single device, and for MLA (the latent is not split)."""
    import dataclasses

    from kiln.compiler.kv_layout import kv_cache_nodes, kv_layout

    layout = kv_layout(program)
    mesh = mesh_of(program)
    nodes = kv_cache_nodes(program)
    if mesh.world == 1 or layout.kind != "mha" or not nodes:
        return layout
    graph, node = nodes[0]
    k = graph.node(node.inputs[1])
    heads = local_shape(k.out.shape, placement_of(k), mesh)[1]
    return dataclasses.replace(layout, kv_heads=int(heads))
