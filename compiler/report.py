"""`kiln compile --report`: per-pass changes, per-kernel cost, and the capacity planner.

The planner is the roofline arithmetic every serving engineer does by hand:
  * parameter bytes — what one decode step must stream from memory at least once;
  * KV bytes per token = layers · kv_heads · head_dim · 2 (K and V) · bytes per element;
  * KV tokens that fit = (memory · memory_fraction − parameter bytes) / KV bytes per token;
  * TPOT floor at batch 1 = (parameter bytes + KV bytes of the context) / memory bandwidth;
  * decode turns compute-bound at the batch where 2 · params · B FLOPs take as long as streaming the
    weights: B* = peak FLOP/s · parameter bytes / (2 · params · bandwidth).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kiln.compiler.ir import DTYPE_BYTES, Program, TensorType
from kiln.compiler.ops import OPS
from kiln.compiler.targets import Target


@dataclass(frozen=True)
class Capacity:
    target: str
    num_params: int
    param_bytes: int
    kv_bytes_per_token: int
    kv_layers: int
    memory_bytes: int
    memory_fraction: float
    kv_pool_bytes: int
    kv_tokens: int
    tpot_floor_s: float  # batch 1, empty context
    tpot_floor_ctx_s: float  # batch 1 at `context` tokens
    context: int
    compute_bound_batch: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


# Quantized params (ParamSpec.quant): how many model parameters one element stands for. Scales, zeros and
# group indices count as bytes only; a packed int4 word holds eight weights.
_QUANT_PARAMS_PER_ELEM = {"weight": 1, "qweight": 8}


def _param_count(program: Program) -> tuple[int, int]:
    count = nbytes = 0
    for spec in program.params.values():
        layers = program.blocks[spec.block].count if spec.block else 1
        n = math.prod(spec.shape)
        count += n * layers * (1 if spec.quant is None else _QUANT_PARAMS_PER_ELEM.get(spec.quant.get("role"), 0))
        nbytes += n * layers * DTYPE_BYTES[spec.dtype]
    return count, nbytes


def kv_cache_dtype(program: Program) -> str | None:
    """"fp8e4m3" when the quantize_kv_cache pass stored the attention KV (or MLA latent) in fp8, else None."""
    for g in program.graphs.values():
        for _, n in g.items():
            if n.op in ("attention", "mla_attention") and n.attrs.get("kv_dtype"):
                return n.attrs["kv_dtype"]
    return None


def kv_geometry(program: Program) -> tuple[int, int, int]:
    """(attention layers, kv_heads, head_dim) over the whole layer schedule."""
    layers, kv_heads, head_dim = 0, 0, 0
    for spec in program.blocks.values():
        g = program.graphs[spec.graph]
        for _, n in g.items():
            if n.op == "attention":
                k = g.node(n.inputs[1]).out
                assert isinstance(k, TensorType)
                layers += spec.count
                kv_heads, head_dim = int(k.shape[1]), int(k.shape[2])
    return layers, kv_heads, head_dim


def mla_kv_geometry(program: Program) -> tuple[int, int]:
    """(MLA layers, latent_dim = kv_lora_rank + qk_rope_head_dim) over the layer schedule; MLA caches only
    the latent, so KV bytes per token = layers · latent_dim · bytes per element."""
    layers, latent = 0, 0
    for spec in program.blocks.values():
        g = program.graphs[spec.graph]
        for _, n in g.items():
            if n.op == "mla_attention":
                c_kv, k_pe = g.node(n.inputs[2]).out, g.node(n.inputs[3]).out
                assert isinstance(c_kv, TensorType) and isinstance(k_pe, TensorType)
                layers += spec.count
                latent = int(c_kv.shape[-1]) + int(k_pe.shape[-1])
    return layers, latent


def draft_kv_layers(program: Program) -> dict[str, int]:
    """Attention layers per named forward (a draft head such as MTP): their KV caches are part of the pool."""
    out: dict[str, int] = {}
    for name in program.forward_graphs()[1:]:
        n = 0
        for _, node in program.graphs[name].items():
            if node.op in ("attention", "mla_attention"):
                n += 1
            elif node.op == "block":
                spec = program.blocks[node.attrs["block"]]
                n += spec.count * sum(program.graphs[spec.graph].count(op) for op in ("attention", "mla_attention"))
        out[name] = n
    return out


def expert_param_bytes(program: Program) -> tuple[int, int]:
    """(bytes of routed-expert weights, of them the bytes one token reads) over the layer schedule.

    An expert weight is a `moe_experts` weight input ([E, ...]); a token reads top_k of its E experts, top_k
    being the routing ids' width. Dense programs give (0, 0).
    """
    total = active = 0
    for spec in program.blocks.values():
        g = program.graphs[spec.graph]
        for _, n in g.items():
            if n.op != "moe_experts":
                continue
            top_k = g.node(n.inputs[2]).out.shape[1]
            for w in n.inputs[3:]:
                p = g.node(w)
                if p.op != "param":
                    continue
                ps = program.params[p.attrs["name"]]
                nbytes = DTYPE_BYTES[ps.dtype] * spec.count * math.prod(ps.shape)
                total += nbytes
                active += nbytes * top_k // ps.shape[0]
    return total, active


def capacity(program: Program, target: Target, *, memory_fraction: float = 0.9, kv_dtype: str | None = None,
             context: int = 1024) -> Capacity:
    num_params, param_bytes = _param_count(program)
    layers, kv_heads, head_dim = kv_geometry(program)
    kv_dtype = kv_dtype or kv_cache_dtype(program)
    kv_elem = DTYPE_BYTES[kv_dtype or program.dtype]
    kv_per_token = layers * kv_heads * head_dim * 2 * kv_elem
    mla_layers, latent_dim = mla_kv_geometry(program)
    if mla_layers:
        layers, kv_per_token = layers + mla_layers, kv_per_token + mla_layers * latent_dim * kv_elem
    pool = max(0, int(target.memory_bytes * memory_fraction) - param_bytes)
    # Embedding rows are gathered, not streamed, in a decode step; the planner still counts all weights,
    # the conservative (and customary) floor.
    tpot = param_bytes / target.bandwidth
    tpot_ctx = (param_bytes + kv_per_token * context) / target.bandwidth
    peak = target.fp8_flops if program.dtype == "fp8e4m3" else target.bf16_flops
    b_star = peak * param_bytes / (2 * num_params * target.bandwidth)
    return Capacity(target.name, num_params, param_bytes, kv_per_token, layers, target.memory_bytes,
                    memory_fraction, pool, pool // kv_per_token if kv_per_token else 0, tpot, tpot_ctx, context,
                    b_star)


def kernel_costs(program: Program, tokens: int = 1) -> list[tuple[str, int, int, int]]:
    """(kernel id, calls per step, FLOPs, bytes) summed over the layer schedule, with T = `tokens`."""
    calls: Counter[str] = Counter()
    flops: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    reps = {**dict.fromkeys(program.forward_graphs(), 1), **{b.graph: b.count for b in program.blocks.values()}}
    for gname, g in program.graphs.items():
        for _, n in g.items():
            kernel = n.attrs.get("kernel", n.op)
            if kernel == "inline" or n.op in ("input", "param", "block", "getitem"):
                continue
            cost_fn = OPS[n.op].cost
            calls[kernel] += reps[gname]
            if cost_fn is None or n.out is None:
                continue
            ins = [_bind(g.node(i).out, tokens) for i in n.inputs]
            c = cost_fn(ins, _bind(n.out, tokens), n.attrs)
            flops[kernel] += c.flops * reps[gname]
            nbytes[kernel] += c.bytes * reps[gname]
    return sorted(((k, calls[k], flops[k], nbytes[k]) for k in calls), key=lambda r: -r[3])


def _bind(t: Any, tokens: int) -> Any:
    if isinstance(t, TensorType):
        return TensorType(tuple(tokens if isinstance(d, str) else d for d in t.shape), t.dtype)
    return type(t)(tuple(_bind(x, tokens) for x in t.items))


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _moe_lines(program: Program, param_bytes: int) -> list[str]:
    experts, active = expert_param_bytes(program)
    if not experts:
        return []
    return [f"  active per token       {_gb(param_bytes - experts + active)} of {_gb(param_bytes)} "
            f"(non-expert {_gb(param_bytes - experts)} + routed experts {_gb(active)} of {_gb(experts)}: top_k/E)"]


def _weight_dtypes(program: Program) -> str:
    """The program dtype, or e.g. "f32 + fp8 (channel) weights" when weights are quantized."""
    schemes = sorted({f"{s.quant['scheme']}" + (f" ({s.quant['granularity']})" if s.quant.get("granularity") else "")
                      for s in program.params.values() if s.quant is not None and s.quant.get("role") != "kv_scale"})
    return program.dtype + (f" + {', '.join(schemes)} weights with scales" if schemes else "")


def format_report(program: Program, target: Target, pass_log: list[dict[str, Any]], *,
                  memory_fraction: float) -> str:
    kv_dtype = kv_cache_dtype(program)
    cap = capacity(program, target, memory_fraction=memory_fraction, kv_dtype=kv_dtype)
    mla_layers, latent_dim = mla_kv_geometry(program)
    kv_formula = (f"{cap.kv_layers} layers x kv_heads x head_dim x 2" if not mla_layers else
                  f"{mla_layers} MLA layers x latent {latent_dim} (kv_lora_rank + rope dim)")
    drafts = draft_kv_layers(program)
    if any(drafts.values()):
        kv_formula += "; of the layers, " + ", ".join(f"{n} for draft head '{d}'" for d, n in drafts.items() if n)
    out = [f"kiln compile report — {program.name} for {target.name} ({target.description})", "", "passes:"]
    for rec in pass_log:
        nb, na = rec["nodes"]
        stats = " ".join(f"{k}={v}" for k, v in rec.get("stats", {}).items())
        out.append(f"  {rec['name']:<24} {'changed' if rec['changed'] else 'unchanged':<9} nodes {nb:>5} -> {na:<5} {stats}")
    out += ["", "kernels (one decode token, batch 1):", f"  {'kernel':<24} {'calls':>6} {'MFLOP':>12} {'MB':>12}"]
    for kernel, calls, fl, by in kernel_costs(program, tokens=1):
        out.append(f"  {kernel:<24} {calls:>6} {fl / 1e6:>12,.2f} {by / 1e6:>12,.2f}")
    out += [
        "",
        "capacity plan:",
        f"  parameters             {cap.num_params:,} ({_gb(cap.param_bytes)} in {_weight_dtypes(program)})",
        *_moe_lines(program, cap.param_bytes),
        f"  KV bytes per token     {cap.kv_bytes_per_token:,} B  (= {kv_formula}"
        f" x {DTYPE_BYTES[kv_dtype or program.dtype]} B)",
        f"  device memory          {_gb(cap.memory_bytes)} x {cap.memory_fraction} = "
        f"{_gb(cap.memory_bytes * cap.memory_fraction)}; minus weights -> KV pool {_gb(cap.kv_pool_bytes)}",
        f"  KV tokens that fit     {cap.kv_tokens:,}",
        f"  TPOT floor, batch 1    {cap.tpot_floor_s * 1e3:.3f} ms  (weights / {target.bandwidth / 1e12:.2f} TB/s);"
        f" {cap.tpot_floor_ctx_s * 1e3:.3f} ms at {cap.context} tokens of context",
        f"  decode compute-bound   from batch ~{cap.compute_bound_batch:.0f} "
        f"(peak {target.bf16_flops / 1e12:.3g} TFLOP/s / {target.bandwidth / 1e12:.3g} TB/s x bytes per param / 2)",
    ]
    return "\n".join(out) + "\n"
