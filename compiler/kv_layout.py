"""The paged KV cache's geometry and the KV pool's size, computed once: the manifest's `kv_cache` section
(codegen) and `kiln compile --report` (compiler/report.py) both read them from here.

One KV tensor per attention op in the layer schedule (the entry's layers, then each draft head's), each
`[num_blocks, 2, block_size, kv_heads, head_dim]` (MHA/GQA) or `[num_blocks, block_size, kv_lora_rank +
rope_dim]` (MLA: the latent only). The pool's size is decided once too: a recipe's `kv_cache.num_blocks`,
else the target's fixed byte budget (cpu), else what the device's memory leaves at load (GPU targets): the
same arithmetic as the runtime's `plan_memory`, whose inputs the manifest records.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.compiler.ir import DTYPE_BYTES, Graph, Node, Program, TensorType
from kiln.dsl.errors import SourceError

KV_CACHE_OPS = ("attention", "mla_attention")
FP8_KV = "fp8e4m3"  # the quantize_kv_cache pass's attrs["kv_dtype"]


class KVLayoutError(SourceError):
    """The attention layers cannot share one paged KV pool (mixed MHA/MLA, shapes or KV dtypes)."""


def _nodes(graph: Graph) -> Iterator[Node]:
    return (node for _, node in graph.items())


def kv_cache_nodes(program: Program, forward: str | None = None) -> list[tuple[Graph, Node]]:
    """(graph, attention node) per KV cache, in cache-index order (layer schedule, then dataflow order): the
    entry's caches, then each named forward's (a draft head's layers own caches of their own). `forward`
    limits the list to that forward graph's caches."""
    out: list[tuple[Graph, Node]] = []
    for name in [forward] if forward is not None else program.forward_graphs():
        top = program.graphs[name]
        for node in _nodes(top):
            if node.op in KV_CACHE_OPS:
                out.append((top, node))
            elif node.op == "block":
                spec = program.blocks[node.attrs["block"]]
                graph = program.graphs[spec.graph]
                out.extend([(graph, n) for n in _nodes(graph) if n.op in KV_CACHE_OPS] * spec.count)
    return out


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The geometry of every KV tensor of a program (they are all alike: the runtime allocates one pool)."""

    kind: str  # "mha" (K and V per KV head) or "mla" (the latent: c_kv | k_pe)
    num_layers: int  # KV tensors: attention ops over the layer schedule, draft heads' included
    dtype: str  # IR dtype of the cache: the program's, or fp8e4m3 (quantize_kv_cache)
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    draft_layers: dict[str, int] = field(default_factory=dict)  # of num_layers, those of each named forward

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.latent_dim if self.kind == "mla" else 2 * self.kv_heads * self.head_dim
        return self.num_layers * per_layer * self.elem_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def formula(self) -> str:
        """How bytes_per_token is made, for the report."""
        if self.kind == "mla":
            text = f"{self.num_layers} MLA layers x latent {self.latent_dim} (kv_lora_rank + rope dim)"
        else:
            text = f"{self.num_layers} layers x kv_heads x head_dim x 2"
        drafts = {d: n for d, n in self.draft_layers.items() if n}
        if drafts:
            text += "; of the layers, " + ", ".join(f"{n} for draft head '{d}'" for d, n in drafts.items())
        return text


def kv_layout(program: Program) -> KVLayout:
    """The KV geometry of a typed program; KVLayoutError when its attention layers cannot share one pool."""
    nodes = kv_cache_nodes(program)
    ops = {node.op for _, node in nodes}
    if len(ops) > 1:
        raise KVLayoutError("a model mixing MLA and MHA attention layers needs two KV layouts; the runtime has one "
                            "per model", next(n for _, n in nodes if n.op == "mla_attention").loc)
    fp8 = {node.attrs.get("kv_dtype") == FP8_KV for _, node in nodes}
    if len(fp8) > 1:
        raise KVLayoutError("some attention layers cache K/V in fp8 and some do not; the runtime allocates one "
                            "KV dtype", None)
    dtype = FP8_KV if fp8 == {True} else program.dtype
    drafts = {name: len(kv_cache_nodes(program, name)) for name in program.forward_graphs()[1:]}
    if ops == {"mla_attention"}:
        dims = set()
        for graph, node in nodes:
            c_kv, k_pe = _typed(graph, node, 2), _typed(graph, node, 3)
            dims.add((int(c_kv.shape[-1]), int(k_pe.shape[-1])))
        if len(dims) > 1:
            raise KVLayoutError(f"MLA layers differ in latent shape {sorted(dims)}; the paged cache needs one", None)
        rank, rope = dims.pop()
        return KVLayout("mla", len(nodes), dtype, kv_lora_rank=rank, rope_dim=rope, draft_layers=drafts)
    heads = {(int(k.shape[1]), int(k.shape[2])) for k in (_typed(g, n, 1) for g, n in nodes)}
    if len(heads) > 1:
        raise KVLayoutError(f"attention layers differ in KV shape {sorted(heads)}; the paged KV cache needs one "
                            "(kv_heads, head_dim) for all layers", None)
    kv_heads, head_dim = heads.pop() if heads else (0, 0)
    return KVLayout("mha", len(nodes), dtype, kv_heads=kv_heads, head_dim=head_dim, draft_layers=drafts)


def _typed(graph: Graph, node: Node, k: int) -> TensorType:
    t = graph.node(node.inputs[k]).out
    if not isinstance(t, TensorType):
        raise KVLayoutError("attention inputs are untyped; run shape_inference first", node.loc)
    return t


# ---------------------------------------------------------------- the pool


def activation_bytes_per_token(program: Program, graph: str, *, skip: tuple[str, ...] = ()) -> int:
    """Bytes of every token-sized (symbolic-dim) value `graph` computes, per token: an upper bound on what is
    live at once inside it. Ops in `skip` are left out."""
    total = 0
    for node in _nodes(program.graphs[graph]):
        t = node.out
        if (isinstance(t, TensorType) and any(isinstance(d, str) for d in t.shape) and node.op != "input"
                and node.op not in skip):
            total += t.numel() * DTYPE_BYTES.get(t.dtype, 4)
    return total


def step_activation_bytes(program: Program, tokens: int, rows: int | None = None) -> int:
    """An estimate of one step's activation peak at `tokens` tokens: the entry graph's token-sized values and the
    largest layer's (the allocator reuses a layer's blocks for the next). With `rows`, the logits are computed
    for that many rows only (a prefill samples one token per sequence), not for every token."""
    blocks = {spec.graph for spec in program.blocks.values()}
    skip = ("logits",) if rows is not None else ()
    per_token = activation_bytes_per_token(program, "entry", skip=skip) + max(
        (activation_bytes_per_token(program, g) for g in blocks), default=0)
    logits = 0
    if rows is not None:
        for node in _nodes(program.entry):
            if node.op == "logits" and isinstance(node.out, TensorType):
                logits += rows * int(node.out.shape[-1]) * DTYPE_BYTES.get(node.out.dtype, 4)
    return tokens * per_token + logits


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    """The KV pool a runtime will allocate, and from what: `source` is "num_blocks" (the recipe's), "pool_bytes"
    (the target's fixed budget) or "memory_fraction" (sized at load from the device's memory)."""

    source: str
    block_size: int
    blocks: int
    bytes: int
    parts: dict[str, Any] = field(default_factory=dict)  # memory_fraction: the terms of the subtraction

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def plan_kv_pool(layout: KVLayout, *, block_size: int, num_blocks: int | None, pool_bytes: int | None,
                 memory_fraction: float, device_memory: int, weight_bytes: int, activation_peak: int,
                 graph_reserve: int) -> KVPoolPlan:
    """The runtime's `plan_memory` for the manifest's sizing decision: the recipe's num_blocks, else the
    target's pool_bytes, else memory_fraction x device memory - weights - activation peak - CUDA-graph reserve
    (the runtime measures the peak and reads the device's memory at load; here they are the estimate and the
    datasheet's)."""
    per_block = layout.bytes_per_block(block_size)
    if num_blocks is not None:
        return KVPoolPlan("num_blocks", block_size, num_blocks, num_blocks * per_block)
    if pool_bytes is not None:
        blocks = pool_bytes // per_block if per_block else 0
        return KVPoolPlan("pool_bytes", block_size, blocks, blocks * per_block, {"pool_bytes": pool_bytes})
    budget = int(memory_fraction * device_memory) - weight_bytes - activation_peak - graph_reserve
    blocks = max(budget, 0) // per_block if per_block else 0
    return KVPoolPlan("memory_fraction", block_size, blocks, blocks * per_block,
                      {"memory_fraction": memory_fraction, "device_memory": device_memory, "weights": weight_bytes,
                       "activation_peak": activation_peak, "graph_reserve": graph_reserve})
