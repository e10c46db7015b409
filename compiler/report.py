"""`kiln compile --report`: per-pass changes, per-kernel cost, and the capacity planner.

The planner is the roofline arithmetic every serving engineer does by hand:
  * parameter bytes — what one decode step must stream from memory at least once;
  * KV bytes per token = layers · kv_heads · head_dim · 2 (K and V) · bytes per element;
  * the KV pool the runtime will allocate (compiler/kv_layout.py, the manifest's decision): the recipe's
    kv_cache.num_blocks, else the target's fixed budget (cpu), else memory · memory_fraction − parameter
    bytes − the activation peak − the CUDA-graph reserve (GPU targets, sized at load); tokens = blocks · block_size;
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
from kiln.compiler.kv_layout import KVLayout, KVPoolPlan, kv_layout, plan_kv_pool, step_activation_bytes
from kiln.compiler.ops import OPS
from kiln.compiler.options import CUDA_GRAPH_PLAN, RecipeOptions
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
    kv_pool_bytes: int  # what the runtime will allocate (kv_layout.plan_kv_pool: the manifest's decision)
    kv_tokens: int
    tpot_floor_s: float  # batch 1, empty context
    tpot_floor_ctx_s: float  # batch 1 at `context` tokens
    context: int
    compute_bound_batch: float
    kv_pool: KVPoolPlan | None = None
    kv: KVLayout | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("kv_pool", "kv")}


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


def expert_param_bytes(program: Program) -> tuple[int, int]:
    """(bytes of routed-expert weights, of them the bytes one token reads) over the layer schedule.

    An expert weight is a `moe_experts` weight input ([E, ...]); a token reads top_k of its E experts, top_k
    being the routing ids' width. Dense programs give (0, 0).
    """
    total = active = 0
    for spec in program.blocks.values():
        g = program.graphs[spec.graph]
        for _, n in g.items():
            if n.op not in ("moe_experts", "moe_experts_a2a"):
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


def kv_pool_plan(program: Program, target: Target, *, memory_fraction: float | None = None,
                 weight_bytes: int | None = None, kv: KVLayout | None = None) -> KVPoolPlan:
    """The KV pool the runtime will allocate for this program on `target` (the manifest records the same
    decision: codegen/artifact.py). On a GPU target the device's memory is the datasheet's and the activation
    peak (measured at load) an estimate from the IR."""
    options = RecipeOptions.from_meta(program.meta)
    kv_opts, sched = options.kv_cache, options.scheduler
    fraction = float(kv_opts.memory_fraction if memory_fraction is None else memory_fraction)
    tokens = sched.max_batched_tokens
    size = max(1, min(sched.chunked_prefill or tokens, tokens))
    rows = min(-(-tokens // size), sched.max_seqs)  # sequences of the runtime's profile prefill
    plan = program.meta.get(CUDA_GRAPH_PLAN) or {}
    return plan_kv_pool(kv_layout(program) if kv is None else kv, block_size=options.kv_cache.block_size, num_blocks=kv_opts.num_blocks,
                        pool_bytes=target.kv_pool_bytes if kv_opts.num_blocks is None else None, memory_fraction=fraction,
                        device_memory=target.memory_bytes,
                        weight_bytes=_param_count(program)[1] if weight_bytes is None else weight_bytes,
                        activation_peak=step_activation_bytes(program, tokens, rows),
                        graph_reserve=int(plan.get("estimated_bytes", 0)))


def capacity(program: Program, target: Target, *, memory_fraction: float | None = None,
             context: int = 1024) -> Capacity:
    num_params, param_bytes = _param_count(program)
    kv = kv_layout(program)
    pool = kv_pool_plan(program, target, memory_fraction=memory_fraction, weight_bytes=param_bytes)
    # Embedding rows are gathered, not streamed, in a decode step; the planner still counts all weights,
    # the conservative (and customary) floor.
    tpot = param_bytes / target.bandwidth
    tpot_ctx = (param_bytes + kv.bytes_per_token * context) / target.bandwidth
    peak = target.fp8_flops if program.dtype == "fp8e4m3" else target.bf16_flops
    b_star = peak * param_bytes / (2 * num_params * target.bandwidth)
    fraction = pool.parts.get("memory_fraction", float(RecipeOptions.from_meta(program.meta).kv_cache.memory_fraction
                                                        if memory_fraction is None else memory_fraction))
    return Capacity(target.name, num_params, param_bytes, kv.bytes_per_token, kv.num_layers, target.memory_bytes,
                    fraction, pool.bytes, pool.tokens, tpot, tpot_ctx, context, b_star, pool, kv)


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


def _step_budget_line(options: RecipeOptions, target: Target) -> str:
    """The scheduler's step budget and whose it is: the recipe's, or the target's default (compiler/targets.py)."""
    sched = options.scheduler
    whose = ("the recipe's scheduler.max_batched_tokens" if options.loc("scheduler.max_batched_tokens") is not None
             else f"the {target.name} target's default; scheduler.max_batched_tokens sets another")
    chunk = f"prefill chunks of {sched.chunked_prefill:,}" if sched.chunked_prefill else "prompts unchunked"
    return f"  tokens a step          {sched.max_batched_tokens:,}  ({whose}; {chunk}, {sched.max_seqs:,} sequences at most)"


def _pool_lines(cap: Capacity, target: Target, speculative: str | None = None) -> list[str]:
    """How the runtime will size the KV pool, with the figures (kv_layout.plan_kv_pool); with a draft model or
    an EAGLE head (`speculative`), what this prediction leaves out."""
    lines = _target_pool_lines(cap, target)
    if speculative in ("draft", "eagle") and cap.kv_pool.source != "num_blocks":
        lines.append(f"                         (less at load: the {speculative} proposer's own KV pool and weights "
                     "share this budget — runtime/worker/memory_plan.py — and are not in this prediction)")
    return lines


def _target_pool_lines(cap: Capacity, target: Target) -> list[str]:
    pool = cap.kv_pool
    head = f"  KV pool                {_gib(pool.bytes)} = {pool.blocks:,} blocks of {pool.block_size} tokens"
    if pool.source == "num_blocks":
        return [head + " (the recipe's kv_cache.num_blocks)"]
    if pool.source == "pool_bytes":
        return [head + f" (the {target.name} target's budget of {_gib(pool.parts['pool_bytes'])}; "
                       "kv_cache.num_blocks sets another)"]
    p = pool.parts
    return [head + ", sized at load:",
            f"                         {p['memory_fraction']} x {_gb(p['device_memory'])} device memory (datasheet; "
            f"the runtime reads the device's) - weights {_gb(p['weights'])} - activation peak ~{_gb(p['activation_peak'])} "
            f"(estimated here, measured at load) - CUDA-graph reserve {_gb(p['graph_reserve'])}"]


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_report(program: Program, target: Target, pass_log: list[dict[str, Any]], *,
                  memory_fraction: float | None = None) -> str:
    cap = capacity(program, target, memory_fraction=memory_fraction)
    kv = cap.kv
    options = RecipeOptions.from_meta(program.meta)
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
        f"  KV bytes per token     {cap.kv_bytes_per_token:,} B  (= {kv.formula()} x {kv.elem_bytes} B)",
        *_pool_lines(cap, target, options.speculative.method),
        f"  KV tokens that fit     {cap.kv_tokens:,}",
        _step_budget_line(options, target),
        f"  TPOT floor, batch 1    {cap.tpot_floor_s * 1e3:.3f} ms  (weights / {target.bandwidth / 1e12:.2f} TB/s);"
        f" {cap.tpot_floor_ctx_s * 1e3:.3f} ms at {cap.context} tokens of context",
        f"  decode compute-bound   from batch ~{cap.compute_bound_batch:.0f} "
        f"(peak {target.bf16_flops / 1e12:.3g} TFLOP/s / {target.bandwidth / 1e12:.3g} TB/s x bytes per param / 2)",
        *_parallel_lines(program, target, memory_fraction),
    ]
    return "\n".join(out) + "\n"


def _parallel_lines(program: Program, target: Target, memory_fraction: float | None) -> list[str]:
    """A parallel program's plan per rank (every rank holds alike): its weights, its KV pool, the collectives of
    a decode step with their bytes, and the step's communication floor at the target's interconnect bandwidth
    beside its memory-bandwidth floor (where tensor parallelism stops paying: the first outgrows the second)."""
    from kiln.compiler.placement import collectives, local_kv_layout, mesh_of, rank_param_bytes

    mesh = mesh_of(program)
    if mesh.world == 1:
        return []
    rank_bytes = rank_param_bytes(program, mesh)
    kv = local_kv_layout(program)
    pool = kv_pool_plan(program, target, memory_fraction=memory_fraction, weight_bytes=rank_bytes, kv=kv)
    attention = ("data-parallel (each rank its own sequences and their KV)" if mesh.attention == "dp"
                 else "tensor-parallel (each rank its heads)")
    out = ["", f"parallel plan (tp = {mesh.tp}, dp = {mesh.dp}, ep = {mesh.ep}: {mesh.world} ranks; attention "
               f"{attention}), per rank:",
           f"  parameter bytes        {rank_bytes:,} B ({_gb(rank_bytes)})",
           f"  KV bytes per token     {kv.bytes_per_token:,} B  (= {kv.formula()} x {kv.elem_bytes} B)",
           f"  KV tokens that fit     {pool.tokens:,}  ({_gib(pool.bytes)} = {pool.blocks:,} blocks)",
           "  collectives            (bytes each rank contributes per token; ring: all-reduce sends 2(n-1)/n of it,"
           " a gather (n-1)/n)"]
    colls = collectives(program)
    wire = 0.0
    for c in colls:
        where = f"{c.graph} x{c.count}" if c.count > 1 else c.graph
        out.append(f"    {where:<20} {c.op:<24} %{c.value:<22} {c.bytes_per_token:>10,} B per {c.per}")
        wire += c.wire_bytes(mesh) * c.count
    calls = sum(c.count for c in colls)
    mem = rank_bytes / target.bandwidth
    if target.interconnect_bandwidth:
        comm = wire / target.interconnect_bandwidth
        out.append(f"  decode step, batch 1   communication floor {comm * 1e6:,.2f} us ({wire:,.0f} B over "
                   f"{target.interconnect} at {target.interconnect_bandwidth / 1e9:,.0f} GB/s; {calls} collectives, "
                   f"each also a latency) vs memory floor {mem * 1e6:,.2f} us (rank weights / "
                   f"{target.bandwidth / 1e12:.2f} TB/s); communication grows with the batch, weights do not")
    return out
