"""Adds a low-rank (LoRA) branch after every checkpoint-sourced linear of the repeated blocks."""
from __future__ import annotations

from kiln.compiler import Graph, Node, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.ir import Attrs, ParamSpec, TensorType
from kiln.compiler.options import RecipeOptions
from kiln.compiler.placement import LINEAR_OPS, PlacementError, infer_placement, placement_of
from kiln.dsl.errors import KilnError

WEIGHT_SUFFIX = ".weight"


def _modules(spec: ParamSpec) -> tuple[str, ...] | None:
    """The checkpoint module paths of a weight's sources ("model.layers.{i}.self_attn.q_proj" for
    ".../q_proj.weight"), the PEFT names of the modules an adapter adapts; None when one is not a `.weight`."""
    if not spec.source or any(not s.endswith(WEIGHT_SUFFIX) for s in spec.source):
        return None
    return tuple(s[: -len(WEIGHT_SUFFIX)] for s in spec.source)


def _part_rows(graph: Graph, vid: str, spec: ParamSpec) -> tuple[int, ...] | None:
    """Rows of each source in the linear's output: the whole output for one source; for a fused weight (several
    sources, concatenated along dim 0 by fuse_qkv / fuse_gate_up) the slices the fusion left, which partition
    the output in source order, or the two halves a silu_mul reads. None otherwise (the linear is not adapted)."""
    n = spec.shape[0]
    if len(spec.source) == 1:
        return (n,)
    if spec.concat_dim != 0:
        return None
    users = [graph.node(u) for u in graph.users(vid)]
    if users and all(u.op == "silu_mul" for u in users) and len(spec.source) == 2 and n % 2 == 0:
        return (n // 2, n // 2)  # fuse_silu_mul's silu(gate) * up over [gate | up], halves by its contract
    if not users or any(u.op != "slice" for u in users):
        return None
    bounds = sorted({(u.attrs["start"], u.attrs["stop"]) for u in users})
    if len(bounds) != len(spec.source) or bounds[0][0] != 0 or bounds[-1][1] != n:
        return None
    if any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return tuple(stop - start for start, stop in bounds)


@register_pass("lora_injection", requires=("shape_inference",),
               after=("quantize_weights", "fuse_qkv", "fuse_gate_up", "fuse_silu_mul", "fuse_add_rms_norm",
                      "mla_absorption", "fuse_dequant_linear", "fuse_rope_kv_write",
                      # placed programs: a lora node takes its linear's placement (the branch shards with it)
                      "place_parallel", "fuse_all_reduce_add_rms_norm"),
               before=("kernel_selection", "cuda_graph_plan"))
class LoRAInjection(Pass):
    """Requires: typed IR, after fusion (a fused q/k/v or gate/up linear is adapted as one, its modules side by
    side); the recipe's `lora { max_rank }` (ctx.options, else program.meta, else the constructor's). Guarantees:
    in every block graph used by one block, each `linear(x, w[, b])` whose weight is a plain float param read from
    `<module>.weight` checkpoint tensors, and each quantized GEMM (`linear_fp8`, `linear_w4a16`) over a module's
    quantized tensors, is followed by `lora(x, y) {target=w's name, modules=its modules' paths,
    rows=each module's output rows, max_rank}`, which every reader of y reads instead. The model's meaning with
    no adapter is unchanged (lora's reference is y); adapters are run-time state the runtime pages into slots.
    In a placed program (after place_parallel) each lora node is placed as its linear's output: column-parallel
    (R, S) -> S, each rank's B its output rows; row-parallel (S, P) -> P, each rank's A its input columns, the
    branch's partial sum added before the base's all_reduce (compiler/placement.py `_lora`)."""

    def __init__(self, max_rank: int | None = None):
        self.max_rank = max_rank

    def run(self, program: Program, ctx: PassContext) -> Program:
        max_rank = self.max_rank
        if max_rank is None:
            try:
                max_rank = RecipeOptions.from_meta(ctx.options or program.meta).lora.max_rank
            except KilnError as e:
                raise PassError(str(e)) from None
        users_of_graph: dict[str, int] = {}
        for block in program.blocks.values():
            users_of_graph[block.graph] = users_of_graph.get(block.graph, 0) + 1
        graphs: dict[str, Graph] = {}
        adapted = 0
        for gname, count in users_of_graph.items():
            if count != 1:  # one graph, several blocks' weights: a target would name one block's
                continue
            g, n = _inject(program, program.graphs[gname], max_rank)
            if n:
                graphs[gname], adapted = g, adapted + n
        ctx.stats["adapted"] = adapted
        return program.with_graphs(graphs) if graphs else program


def _inject(program: Program, graph: Graph, max_rank: int) -> tuple[Graph, int]:
    g: Graph | None = None
    n = 0
    for vid, node in list(graph.items()):
        spec = _adapted_weight(program, graph, node)
        if spec is None:
            continue
        if spec.quant is not None:
            modules, rows = _quantized_modules(spec)
        else:
            modules, rows = _modules(spec), _part_rows(graph, vid, spec)
        if modules is None or rows is None:
            continue
        g = g or graph.copy()
        attrs = Attrs({"target": spec.name, "modules": modules, "rows": rows, "max_rank": max_rank})
        lora = Node("lora", (node.inputs[0], vid), attrs, node.out, node.loc)
        placed = _placed(graph, lora)
        lora_vid = g.fresh(f"{vid}_lora")
        g.add(lora_vid, placed)
        g.replace_all_uses(vid, lora_vid)  # every reader of y but the lora node itself
        n += 1
    return (g or graph), n


def _placed(graph: Graph, lora: Node) -> Node:
    """`lora` with the placement its inputs give it, in a placed program (place_parallel ran): its linear's output
    placement, column-parallel (B sliced by output rows) or row-parallel (A sliced by input columns, partial)."""
    x, y = (placement_of(graph.node(i)) for i in lora.inputs)
    if y is None:
        return lora
    try:
        p = infer_placement(lora, [x, y], [graph.node(i).out for i in lora.inputs])
    except PlacementError as e:
        raise PassError(f"lora_injection: {lora.attrs['target']}: {e}") from None
    return lora.with_(attrs=lora.attrs.replace(placement=str(p)))


def _quantized_modules(spec: ParamSpec) -> tuple[tuple[str, ...] | None, tuple[int, ...] | None]:
    """The modules and output rows of a quantized GEMM's first weight param (fp8 `<module>.weight`, AWQ/GPTQ
    `<module>.qweight`): one module of all N rows, or the parts fuse_qkv / fuse_gate_up merged, in order."""
    q = spec.quant
    suffix = "." + ("weight" if q["scheme"] == "fp8" else q["role"])
    if not spec.source or any(not src.endswith(suffix) for src in spec.source):
        return None, None
    rows = tuple(r for _, r in q["parts"]) if q.get("parts") else (q["weight_shape"][0],)
    if len(rows) != len(spec.source):
        return None, None
    return tuple(src[: -len(suffix)] for src in spec.source), rows


def _adapted_weight(program: Program, graph: Graph, node: Node) -> ParamSpec | None:
    """The weight of a linear the pass adapts: a plain float param, or the first param of a quantized GEMM
    (linear_fp8, linear_w4a16: the branch reads x and adds to y, whatever the base's weight format)."""
    if node.op not in LINEAR_OPS or not isinstance(node.out, TensorType):
        return None
    w = graph.node(node.inputs[1])
    if w.op != "param":
        return None
    spec = program.params.get(w.attrs["name"])
    if spec is None:
        return None
    if node.op != "linear":  # a quantized GEMM: its first param is the packed / e4m3 weight
        return spec if spec.quant is not None and spec.quant.get("role") in ("weight", "qweight") else None
    if spec.quant is not None or spec.dtype not in ("f32", "bf16", "f16"):
        return None
    return spec

