"""Picks the kernel that runs each node on the target, by id (`attrs["kernel"]`)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kiln.compiler import Graph, Pass, PassContext, PassError, Program, register_pass

INLINE = "inline"  # structural ops the generated executor emits inline: no kernel launch
_STRUCTURAL = ("input", "param", "block", "getitem", "view", "slice")

# target -> op -> kernel id. A target is added by registering its table; kernel source lives in codegen.
KERNEL_TABLES: dict[str, Mapping[str, str]] = {}


def register_kernels(target: str, table: Mapping[str, str]) -> None:
    """Declares the kernel id of every op on `target` (structural ops are added as `inline`)."""
    assert target not in KERNEL_TABLES, f"kernels for target {target!r} registered twice"
    KERNEL_TABLES[target] = {**dict.fromkeys(_STRUCTURAL, INLINE), **table}


register_kernels("cpu", {
    "embedding": "cpu.embedding",
    "rms_norm": "cpu.rms_norm",
    "add_rms_norm": "cpu.add_rms_norm",
    "linear": "cpu.linear",
    "rope": "cpu.rope",
    "attention": "cpu.paged_attention",
    "silu": "cpu.silu",
    "silu_mul": "cpu.silu_mul",
    "add": "cpu.add",
    "mul": "cpu.mul",
    "concat": "cpu.concat",
    "logits": "cpu.logits",
    "deinterleave": "cpu.deinterleave",
    "mla_attention": "cpu.mla_attention",
    "dequant_fp8": "cpu.dequant_fp8",
    "linear_fp8": "cpu.linear_fp8",
    "dequant_int4": "cpu.dequant_int4",
    "linear_w4a16": "cpu.linear_w4a16",
    "moe_topk_softmax": "cpu.moe_topk_softmax",
    "moe_topk_grouped": "cpu.moe_topk_grouped",
    "moe_experts": "cpu.moe_experts",
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
    "linear": "torch.linear",
    "logits": "torch.logits",
}
_GPU_TABLE = {op: _TRITON_KERNELS.get(op, "torch." + kernel.split(".", 1)[1])
              for op, kernel in KERNEL_TABLES["cpu"].items() if kernel != INLINE}
register_kernels("h100", _GPU_TABLE)
register_kernels("h200", _GPU_TABLE)


class KernelSelectionError(PassError):
    """An op has no kernel on the target, or the target has no kernels at all."""


def kernel_table(target: str) -> Mapping[str, str]:
    try:
        return KERNEL_TABLES[target]
    except KeyError:
        raise KernelSelectionError(f"target {target!r} has no kernels yet (targets with kernels: "
                                   f"{', '.join(sorted(KERNEL_TABLES))})") from None


@register_pass("kernel_selection", requires=("shape_inference",))
class KernelSelection(Pass):
    """Requires: typed IR whose ops all have a kernel on the target (run after fusion). Guarantees: every
    node of every graph has `attrs["kernel"]`, the target table's id for its op (`inline` for structural
    ops). The target is the constructor's, else `ctx.target`. Attributes only: the IR's meaning is unchanged."""

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
                kernel = table.get(node.op)
                if kernel is None:
                    raise KernelSelectionError(f"graph {name!r}: %{vid} = {node.op}: no {target!r} kernel for "
                                               f"op {node.op!r}" + (f" (at {node.loc})" if node.loc else ""))
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
