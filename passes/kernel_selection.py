"""Picks the kernel that runs each node on the target, by id (`attrs["kernel"]`)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kiln.compiler import Graph, Node, Pass, PassContext, PassError, Program, register_pass
from kiln.compiler.ir import TensorType, TupleType
from kiln.compiler.ops import attention_sinks

INLINE = "inline"  # structural ops the generated executor emits inline: no kernel launch
_STRUCTURAL = ("input", "param", "block", "getitem", "view", "slice")


@dataclass(frozen=True)
class KernelChoice:
    """A kernel that runs an op only on the nodes `when(node, input_types)` accepts (dtypes, attributes); a table
    lists choices before the kernel that runs every other node of the op."""

    kernel: str
    when: Callable[[Node, tuple], bool]


# An op's entry: one kernel id, or candidates in order of preference, the last one unconditional.
Entry = str | tuple[KernelChoice | str, ...]

# target -> op -> kernel entry. A target is added by registering its table; kernel source lives in codegen.
KERNEL_TABLES: dict[str, Mapping[str, Entry]] = {}


def register_kernels(target: str, table: Mapping[str, Entry]) -> None:
    """Declares the kernel of every op on `target` (structural ops are added as `inline`)."""
    assert target not in KERNEL_TABLES, f"kernels for target {target!r} registered twice"
    for op, entry in table.items():
        assert isinstance(entry, str) or isinstance(entry[-1], str), f"{target}/{op}: the last choice must be a kernel id"
    KERNEL_TABLES[target] = {**dict.fromkeys(_STRUCTURAL, INLINE), **table}


def select(entry: Entry, node: Node, ins: tuple = ()) -> str:
    """The kernel id `entry` gives `node` (whose inputs have types `ins`): the first choice whose condition holds."""
    if isinstance(entry, str):
        return entry
    for choice in entry:
        if isinstance(choice, str):
            return choice
        if choice.when(node, ins):
            return choice.kernel
    raise AssertionError("unreachable: the last choice is unconditional")


def _dtype_in(*dtypes: str) -> Callable[[Node, tuple], bool]:
    """The node's output (all of a tuple's) is a tensor of one of `dtypes`."""
    def check(node: Node, ins: tuple) -> bool:
        outs = node.out.items if isinstance(node.out, TupleType) else (node.out,)
        return all(isinstance(t, TensorType) and t.dtype in dtypes for t in outs)
    return check


def _inputs_in(*dtypes: str) -> Callable[[Node, tuple], bool]:
    """Every input of the node is a tensor of one of `dtypes`, all of one dtype (the LM head: its output is fp32
    whatever it reads)."""
    def check(node: Node, ins: tuple) -> bool:
        return bool(ins) and all(isinstance(t, TensorType) and t.dtype == ins[0].dtype in dtypes for t in ins)
    return check


def _vocab_parallel(node: Node, ins: tuple) -> bool:
    """An embedding over a vocab-sharded table: its output is a partial (masked) lookup."""
    return node.attrs.get("placement") == "P"


def _tvm_attention(node: Node, ins: tuple) -> bool:
    """tvm.paged_attention: fp32 or bf16 K/V in the activation dtype (an fp8 cache stays on torch), scores not
    soft-capped (Gemma 2's attention runs the torch kernel, which caps them), no sink logits (gpt-oss's runs the
    torch kernel too: the TVM kernel has no sink term in its softmax)."""
    return (not node.attrs.get("kv_dtype") and not node.attrs.get("softcap")
            and attention_sinks(len(node.inputs), node.attrs) is None and _dtype_in("f32", "bf16")(node, ins))


# The cpu target's torch kernels (kernels/cpu.py); the GPU tables below derive from it.
_CPU_TORCH: dict[str, Entry] = {
    "embedding": "cpu.embedding",
    "rms_norm": "cpu.rms_norm",
    "add_rms_norm": "cpu.add_rms_norm",
    "linear": "cpu.linear",
    "rope": "cpu.rope",
    "attention": "cpu.paged_attention",
    "silu": "cpu.silu",
    "gelu_tanh": "cpu.gelu_tanh",
    "scale": "cpu.scale",
    "softcap": "cpu.softcap",
    "silu_mul": "cpu.silu_mul",
    "add": "cpu.add",
    "bias_add": "cpu.bias_add",
    "mul": "cpu.mul",
    "concat": "cpu.concat",
    "logits": "cpu.logits",
    "hidden_rows": "cpu.hidden_rows",
    "deinterleave": "cpu.deinterleave",
    "mla_attention": "cpu.mla_attention",
    "dequant_fp8": "cpu.dequant_fp8",
    "linear_fp8": "cpu.linear_fp8",
    "dequant_int4": "cpu.dequant_int4",
    "linear_w4a16": "cpu.linear_w4a16",
    "moe_topk_softmax": "cpu.moe_topk_softmax",
    "moe_topk_grouped": "cpu.moe_topk_grouped",
    "moe_experts": "cpu.moe_experts",
    "moe_experts_a2a": "cpu.moe_experts_a2a",
    "lora": "cpu.lora",
    # collectives (parallel programs, compiler/placement.py): through the communicator model.py is given
    "all_reduce": "cpu.all_reduce",
    "all_gather": "cpu.all_gather",
    "gather_logits": "cpu.gather_logits",
    "dp_gather": "cpu.dp_gather",
    "dp_scatter": "cpu.dp_scatter",
    "all_reduce_add_rms_norm": "cpu.all_reduce_add_rms_norm",
}
# Kernels built with apache-tvm (kernels/tvm.py + tvm_cpu/cpu.so) where benchmarks/cpu_kernels.py measured them
# faster than the torch kernel (figures in docs/performance.md); every other op stays on torch.
_CPU_TORCH["embedding"] = (KernelChoice("cpu.vocab_parallel_embedding", _vocab_parallel), "cpu.embedding")
register_kernels("cpu", {
    **_CPU_TORCH,
    # a lookup that also reads a table held packed for the LM head (tied embeddings); else F.embedding
    "embedding": (*_CPU_TORCH["embedding"][:-1], KernelChoice("tvm.embedding", _dtype_in("f32", "bf16")),
                  "cpu.embedding"),
    "attention": (KernelChoice("tvm.paged_attention", _tvm_attention), "cpu.paged_attention"),
    "rms_norm": (KernelChoice("tvm.rms_norm", _dtype_in("f32", "bf16")), "cpu.rms_norm"),
    "add_rms_norm": (KernelChoice("tvm.add_rms_norm", _dtype_in("f32", "bf16")), "cpu.add_rms_norm"),
    "silu_mul": (KernelChoice("tvm.silu_mul", _dtype_in("f32", "bf16")), "cpu.silu_mul"),
    "linear": (KernelChoice("tvm.linear", _dtype_in("f32", "bf16")), "cpu.linear"),
    "logits": (KernelChoice("tvm.logits", _inputs_in("f32", "bf16")), "cpu.logits"),
    "all_reduce_add_rms_norm": (KernelChoice("tvm.all_reduce_add_rms_norm", _dtype_in("f32", "bf16")),
                                "cpu.all_reduce_add_rms_norm"),
})

# GPU targets: Triton kernels (codegen/templates/triton/), GEMMs on cuBLAS through torch, and every other op
# as its torch implementation (`torch.<cpu kernel name>`): the same table for h100 and h200.
_TRITON_KERNELS = {
    "embedding": "triton.embedding",
    "rms_norm": "triton.rms_norm",
    "add_rms_norm": "triton.add_rms_norm",
    "rope": "triton.rope",
    "attention": "triton.paged_attention",
    "silu_mul": "triton.silu_mul",
    "moe_experts": "triton.moe_experts",
    "mla_attention": "triton.mla_attention",
    "linear_fp8": "triton.linear_fp8",  # weight-only: Triton GEMM up to 256 rows; act=dynamic: torch._scaled_mm
    "linear_w4a16": "triton.linear_w4a16",
    "lora": "triton.lora",  # segmented (SGMV/BGMV) shrink + expand over every adapter of the step
    "linear": "torch.linear",
    "logits": "torch.logits",
}
def _on_gpu(entry: Entry) -> Entry:
    if isinstance(entry, str):
        return "torch." + entry.split(".", 1)[1]
    return tuple(KernelChoice(_on_gpu(c.kernel), c.when) if isinstance(c, KernelChoice) else _on_gpu(c) for c in entry)


_GPU_TABLE = {op: _TRITON_KERNELS.get(op, _on_gpu(kernel)) for op, kernel in _CPU_TORCH.items()}
_GPU_TABLE["embedding"] = (KernelChoice("torch.vocab_parallel_embedding", _vocab_parallel), "triton.embedding")
_GPU_TABLE["all_reduce_add_rms_norm"] = "triton.all_reduce_add_rms_norm"
register_kernels("h100", _GPU_TABLE)
register_kernels("h200", _GPU_TABLE)


class KernelSelectionError(PassError):
    """An op has no kernel on the target, or the target has no kernels at all."""


def kernel_table(target: str) -> Mapping[str, Entry]:
    try:
        return KERNEL_TABLES[target]
    except KeyError:
        raise KernelSelectionError(f"target {target!r} has no kernels yet (targets with kernels: "
                                   f"{', '.join(sorted(KERNEL_TABLES))})") from None


@register_pass("kernel_selection", requires=("shape_inference",))
class KernelSelection(Pass):
    """Requires: typed IR whose ops all have a kernel on the target (run after fusion). Guarantees: every
    node of every graph has `attrs["kernel"]`, the target table's id for its op (`inline` for structural
    ops; for an op with choices, the first whose condition the node meets). The target is the constructor's, else `ctx.target`. Attributes only: the IR's meaning is unchanged."""

    def __init__(self, target: str | None = None):
        self.target = target

    def run(self, program: Program, ctx: PassContext) -> Program:
        target = self.target or ctx.target
        table = kernel_table(target)
        graphs: dict[str, Graph] = {}
        used: Counter[str] = Counter()
        for name, graph in program.graphs.items():
            g: Graph | None = None
            for vid, node in graph.items():
                entry = table.get(node.op)
                if entry is None:
                    raise KernelSelectionError(f"graph {name!r}: %{vid} = {node.op}: no {target!r} kernel for "
                                               f"op {node.op!r}" + (f" (at {node.loc})" if node.loc else ""))
                kernel = select(entry, node, tuple(graph.node(i).out for i in node.inputs))
                used[kernel] += 1
                if node.attrs.get("kernel") != kernel:
                    g = g or graph.copy()
                    g.replace(vid, node.with_(attrs=node.attrs.replace(kernel=kernel)))
            if g is not None:
                graphs[name] = g
        ctx.stats["kernels"] = dict(sorted(used.items()))
        return program.with_graphs(graphs) if graphs else program

    def __repr__(self) -> str:
        return f"KernelSelection(target={self.target!r})"
