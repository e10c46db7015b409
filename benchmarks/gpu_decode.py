"""Decode and prefill of kiln's h200 executor against their hardware limits, in one run on one GPU.

    python benchmarks/gpu_decode.py [--out DIR] [--models 1b,8b] [--batches 1,8,64,256] [--quant fp8,int4]
    python benchmarks/gpu_decode.py --cpu-smoke     # the same code path on CPU: tiny shapes, Triton interpreter

Measures, for Llama-3.2-1B and Llama-3-8B shapes with random bf16 weights (`weights = random(seed=0)`):
  * ceilings: device-to-device copy bandwidth; bf16 GEMM peak (8192^3 matmul);
  * the weight-streaming limit: a CUDA graph replaying one GEMV (F.linear at batch 1) over every weight matrix
    of the model, the same bytes a decode step must read -> achieved streaming bandwidth;
  * kiln's decode step (generated model.py + Triton kernels, eager, no CUDA graph) at each batch size with
    1K context per sequence: step time, its limit (weight bytes + KV bytes read, at the streaming bandwidth),
    ratio limit/measured, and GPU-busy fraction (kernel time from torch.profiler / wall time);
  * prefill of one 4K-token prompt: time vs FLOPs at the measured GEMM peak.
Then, in the same run, quantized variants of the 8B shape (`--quant`, default fp8,int4; fp8_dynamic opt-in):
  * decode steps at batch 1 and 64 (`--quant-batches`) of `weights = fp8(per_channel=true)` (weight-only
    Triton GEMM), `fp8(per_channel=true, act=dynamic)` (torch._scaled_mm) and `awq(group=128)` (Triton int4
    GEMM), eager and from a CUDA graph; the limit is the quantized weight bytes (+ KV) at the bf16 run's
    streaming bandwidth; tokens/s ratio vs the bf16 8B step at the same batch (CUDA-graph times when both
    captured, else eager);
  * fp8 KV capacity: KV tokens that fit in the same byte budget (device memory x 0.9 minus the bf16 weights),
    sized by the runtime's own code (manifest kv_cache section -> resolve_num_blocks), bf16 vs fp8 KV.
Quantized weights are random tensors in the executor's layout, made on the GPU (no checkpoint, no packing).
Writes DIR/gpu_decode.json (after every model) and prints a table last. Without CUDA it says so and exits 0.
The executor is rendered from the compiled Program (codegen's render_model and kernel templates) and fed
weights made on the GPU, so no 16 GB artifact is written to disk; the code that runs is the artifact's.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

MODELS = {
    "llama-3.2-1b": dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0,
                         tie_embeddings="true"),
    "llama-3-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0),
}
# --cpu-smoke: a model small enough for Triton's interpreter, with K a multiple of the int4 group
SMOKE_MODEL = {"tiny": dict(vocab=512, hidden=128, layers=1, heads=2, kv_heads=1, ffn=256, rope_theta=10000.0)}
QUANT_MODEL = "llama-3-8b"
# --quant names -> the recipe's `quantize { weights = ... }`
QUANT_SCHEMES = {"fp8": "fp8(per_channel=true)", "fp8_dynamic": "fp8(per_channel=true, act=dynamic)",
                 "int4": "awq(group=128)"}
KV_MEMORY_FRACTION = 0.9
BLOCK = 16


@dataclass
class Setup:
    """What differs between the H200 run and --cpu-smoke."""

    device: torch.device
    context: int = 1024
    prefill: int = 4096
    smoke: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _recipe(name: str, cfg: dict, quantize: str = "") -> str:
    args = ", ".join(f"{k}={v}" for k, v in cfg.items())
    q = f"  quantize {{ {quantize} }}\n" if quantize else ""
    return (f"recipe bench_{name.replace('-', '_').replace('.', '_')} {{\n  model = llama({args})\n"
            f"  weights = random(seed=0)\n  target = h200\n  dtype = bf16\n"
            f"  kv_cache {{ block_size = {BLOCK} }}\n{q}}}\n")


def _tag(name: str) -> str:
    return name.replace("-", "_").replace(".", "_")


def compile_program(name: str, cfg: dict, work: Path, quantize: str = ""):
    import kiln

    recipe = work / f"{_tag(name)}.dsl"
    recipe.write_text(_recipe(name, cfg, quantize))
    return kiln.compile(recipe, progress=False).program


def render_executor(program, work: Path, package: str, max_model_len: int) -> tuple[Path, type]:
    """Renders the compiled program's model.py and kernel libraries into `work/package`, as an artifact holds
    them, and imports it: returns (package dir, its Model class). gpu_engine.py and gpu_deepseek_layer.py
    render theirs through this too."""
    from kiln.codegen.artifact import kernel_params
    from kiln.codegen.emitters import KERNEL_MODULES
    from kiln.codegen.render import render_model, template_env

    pkg = work / package
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "model.py").write_text(render_model(program, kiln_version="bench", recipe_hash="0" * 64,
                                               max_model_len=max_model_len))
    params = kernel_params(program)
    env = template_env()
    for ns in params["kernel_modules"]:  # the target's libraries (compiler/targets.py)
        (pkg / "kernels" / f"{ns}.py").write_text(env.get_template(KERNEL_MODULES[ns][0]).render(
            kiln_version="bench", **params))
    sys.path.insert(0, str(work))
    try:
        return pkg, importlib.import_module(f"{package}.model").Model
    finally:
        sys.path.remove(str(work))


def build_executor(name: str, cfg: dict, work: Path, quantize: str = ""):
    """Compiles the recipe (no weights written) and renders model.py + kernels into a package; returns
    (Model class, Program)."""
    program = compile_program(name, cfg, work, quantize)
    _, model_cls = render_executor(program, work, f"exec_{_tag(name)}", 8192)
    return model_cls, program


def _layer_names(program, spec) -> list[str]:
    return [spec.layer_name(i) for i in range(program.blocks[spec.block].count)] if spec.block else [spec.name]


def _quantized_tensor(spec, g: torch.Generator, device) -> torch.Tensor:
    """A random tensor of a quantized param in the executor's layout (values in range, scales small)."""
    role = spec.quant["role"]
    if role == "weight":  # e4m3, |w_q| up to ~256 -> weights ~0.02 with the scale below
        return (torch.randn(spec.shape, generator=g, device=device) * 64).to(torch.float8_e4m3fn)
    if role == "weight_scale":
        return torch.full(spec.shape, 0.02 / 64, dtype=torch.float32, device=device)
    if role in ("qweight", "qzeros"):  # any int32 word is 8 valid nibbles
        return torch.randint(-2**31, 2**31 - 1, spec.shape, generator=g, device=device,
                             dtype=torch.int64).to(torch.int32)
    if role == "scales":
        return torch.full(spec.shape, 0.003, dtype=torch.float16, device=device)  # (q - z) · s: std ~0.02
    if role == "g_idx":
        return (torch.arange(spec.shape[0], device=device) // spec.quant["group"]).to(torch.int32)
    if role == "kv_scale":
        return torch.full(spec.shape, 0.05, dtype=torch.float32, device=device)
    raise ValueError(f"param '{spec.name}': no random tensor for quantized role {role!r}")


def random_weights(program, device) -> dict[str, torch.Tensor]:
    """Weights of the program's dtype made on `device`: norms 1, matrices N(0, 0.02), quantized params in the
    executor's layout (gpu_engine.py and gpu_deepseek_layer.py use these too)."""
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[program.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for spec in program.params.values():
        for n in _layer_names(program, spec):
            if spec.quant is not None:
                out[n] = _quantized_tensor(spec, g, device)
            elif len(spec.shape) == 1:  # norm weights
                out[n] = torch.ones(spec.shape, dtype=dtype, device=device)
            else:
                out[n] = (torch.randn(spec.shape, generator=g, device=device) * 0.02).to(dtype)
    return out


def matrices(weights: dict[str, torch.Tensor], tied: bool) -> list[torch.Tensor]:
    """The matrices one decode step reads: every 2-D weight except the embedding table (rows are gathered),
    which is read whole only as a tied LM head."""
    mats = [w for n, w in weights.items() if w.dim() == 2 and not n.endswith("embed")]
    if tied:
        mats += [w for n, w in weights.items() if n.endswith("embed")]
    return mats


def step_bytes(program, weights: dict[str, torch.Tensor], tied: bool) -> int:
    """Weight bytes one decode step reads: the matrices (packed / fp8 ones with their scales, zeros and
    g_idx), not the norm weights nor the embedding table (unless tied)."""
    quant = {n for spec in program.params.values() if spec.quant is not None for n in _layer_names(program, spec)}
    return (sum(w.numel() * w.element_size() for w in matrices(weights, tied))
            + sum(weights[n].numel() * weights[n].element_size() for n in quant if weights[n].dim() == 1))


def timed(setup: Setup, fn, warmup=3, iters=10) -> float:
    """Median seconds per call: CUDA events on a GPU, perf_counter on CPU (smoke: one call)."""
    if setup.smoke:
        warmup, iters = 0, 1
    for _ in range(warmup):
        fn()
    if not setup.cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(setup: Setup) -> float:
    x = torch.empty((2 * 2**30) if setup.cuda else 2**24, dtype=torch.uint8, device=setup.device)
    y = torch.empty_like(x)
    t = timed(setup, lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / t


def gemm_peak(setup: Setup) -> float:
    n = 8192 if setup.cuda else 256
    a = torch.randn(n, n, device=setup.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=setup.device, dtype=torch.bfloat16)
    t = timed(setup, lambda: a @ b, iters=20)
    return 2 * n**3 / t


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn()`, captured after one warm-up call on a side stream (as torch's docs prescribe)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def streaming_limit(setup: Setup, mats: list[torch.Tensor]) -> tuple[float, float]:
    """(seconds, bytes/s) of a CUDA graph of one batch-1 GEMV per weight matrix (CPU: the GEMVs, eager)."""
    xs = {k: torch.randn(1, k, device=setup.device, dtype=torch.bfloat16) for k in {m.shape[1] for m in mats}}
    nbytes = sum(m.numel() * m.element_size() for m in mats)

    def gemvs():
        for m in mats:
            F.linear(xs[m.shape[1]], m)

    if not setup.cuda:
        t = timed(setup, gemvs, warmup=1, iters=3)
        return t, nbytes / t
    t = timed(setup, capture_graph(gemvs).replay, iters=20)
    return t, nbytes / t


def decode_batch(batch_size: int, context: int, layers_kv: int, kv_heads: int, head_dim: int, device,
                 kv_dtype=torch.bfloat16, vocab: int = 1000):
    from kiln.runtime.forward_batch import ForwardBatch

    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch_size * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    tables = perm.view(batch_size, blocks_per_seq).to(torch.int32)
    pos = context - 1
    slots = tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
    i32 = dict(dtype=torch.int32, device=device)
    fb = ForwardBatch(input_ids=torch.randint(0, vocab, (batch_size,), **i32),  # ids the embedding has
                      positions=torch.full((batch_size,), pos, **i32),
                      query_start_loc=torch.arange(batch_size + 1, **i32),
                      seq_lens=torch.full((batch_size,), context, **i32),
                      block_tables=tables.to(device), slot_mapping=slots.to(device),
                      logits_indices=torch.arange(batch_size, **i32), num_decodes=batch_size)
    kv = [torch.randn(num_blocks, 2, BLOCK, kv_heads, head_dim, device=device).to(kv_dtype)
          for _ in range(layers_kv)]
    return fb, kv


def prefill_batch(tokens: int, layers_kv: int, kv_heads: int, head_dim: int, device, vocab: int = 1000):
    from kiln.runtime.forward_batch import ForwardBatch

    nb = math.ceil(tokens / BLOCK)
    i32 = dict(dtype=torch.int32, device=device)
    fb = ForwardBatch(input_ids=torch.randint(0, vocab, (tokens,), **i32), positions=torch.arange(tokens, **i32),
                      query_start_loc=torch.tensor([0, tokens], **i32), seq_lens=torch.tensor([tokens], **i32),
                      block_tables=torch.arange(nb, **i32)[None], slot_mapping=torch.arange(tokens, device=device),
                      logits_indices=torch.tensor([tokens - 1], **i32), num_decodes=0)
    kv = [torch.zeros(nb, 2, BLOCK, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
          for _ in range(layers_kv)]
    return fb, kv


def busy_fraction(setup: Setup, fn) -> float | None:
    """Sum of GPU kernel time / wall time over 5 calls, by torch.profiler (None if the profiler fails)."""
    if not setup.cuda:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
        return min(1.0, kernel_us / 1e6 / wall) if kernel_us else None
    except Exception as e:  # the profiler needs CUPTI; report the gap rather than fail the run
        print(f"  (profiler unavailable: {type(e).__name__}: {e})")
        return None


def graph_time(setup: Setup, model, fb, kv) -> float | None:
    """Seconds per decode step replayed from a CUDA graph (CUDAGraphRunner, one bucket = this batch; the
    copy into its static buffers included). Block 0 is unused by decode_batch: it is the scratch block.
    None on CPU (no graphs) or when capture fails."""
    if not setup.cuda:
        return None
    from kiln.runtime.worker.graph_runner import CUDAGraphRunner

    try:
        runner = CUDAGraphRunner(model, kv, [fb.num_seqs], fb.block_tables.shape[1], BLOCK, scratch_block=0,
                                 device=setup.device)
        runner.capture()
        return timed(setup, functools.partial(runner.run, fb))
    except Exception as e:  # report, keep measuring the eager path
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {e})")
        return None


def _decode_row(setup: Setup, model, cfg: dict, bs: int, weight_bytes: int, bw_stream: float, profile: bool,
                kv_dtype=torch.bfloat16) -> dict:
    layers, kvh = cfg["layers"], cfg["kv_heads"]
    head_dim = cfg["hidden"] // cfg["heads"]
    fb, kv = decode_batch(bs, setup.context, layers, kvh, head_dim, setup.device, kv_dtype, vocab=cfg["vocab"])
    step = functools.partial(model.forward, fb, kv)
    t = timed(setup, step)
    kv_bytes = bs * setup.context * layers * 2 * kvh * head_dim * kv[0].element_size()
    limit = (weight_bytes + kv_bytes) / bw_stream
    busy = busy_fraction(setup, step) if profile else None
    t_graph = graph_time(setup, model, fb, kv)
    return {"batch": bs, "context": setup.context, "step_s": t, "limit_s": limit, "ratio": limit / t,
            "tokens_per_s": bs / t, "gpu_busy": busy, "graph_step_s": t_graph}


def _print_row(row: dict, indent: str = "  ") -> None:
    t, limit, busy, t_graph = row["step_s"], row["limit_s"], row["gpu_busy"], row["graph_step_s"]
    print(f"{indent}decode b={row['batch']:4d}: {t * 1e3:8.3f} ms (limit {limit * 1e3:.3f} ms, {limit / t:.0%})"
          + (f", GPU busy {busy:.0%}" if busy is not None else "")
          + (f"; CUDA graph {t_graph * 1e3:.3f} ms" if t_graph is not None else ""))


def bench_model(setup: Setup, name: str, cfg: dict, batches: list[int], ceilings: dict, work: Path,
                deadline: float) -> dict:
    Model, program = build_executor(name, cfg, work)
    weights = random_weights(program, setup.device)
    tied = cfg.get("tie_embeddings") == "true"
    mats = matrices(weights, tied)
    weight_bytes = sum(m.numel() * m.element_size() for m in mats)
    t_stream, bw_stream = streaming_limit(setup, mats)
    model = Model(weights, setup.device)
    layers, kvh = cfg["layers"], cfg["kv_heads"]
    head_dim = cfg["hidden"] // cfg["heads"]
    res = {"weight_bytes_read_per_step": weight_bytes, "stream_graph_s": t_stream, "stream_bandwidth": bw_stream,
           "decode": [], "prefill": None}
    print(f"{name}: {weight_bytes / 1e9:.2f} GB of matrices; GEMV stream {t_stream * 1e3:.3f} ms "
          f"({bw_stream / 1e12:.2f} TB/s)")
    for bs in batches:
        if time.time() > deadline:
            print(f"  batch {bs}: skipped (time budget)")
            continue
        row = _decode_row(setup, model, cfg, bs, weight_bytes, bw_stream, profile=bs in (1, 64))
        res["decode"].append(row)
        _print_row(row)
        _empty_cache(setup)
    if time.time() < deadline:
        fb, kv = prefill_batch(setup.prefill, layers, kvh, head_dim, setup.device, vocab=cfg["vocab"])
        t = timed(setup, functools.partial(model.forward, fb, kv), warmup=2, iters=5)
        # layer GEMMs over every token (the LM head runs on the last token only: left out)
        n_params = sum(w.numel() for n, w in weights.items() if w.dim() == 2 and not n.endswith(("embed", "lm_head")))
        flops = 2 * n_params * setup.prefill
        flops += layers * 2 * 2 * cfg["heads"] * head_dim * setup.prefill * setup.prefill / 2  # causal QK^T + PV
        limit = flops / ceilings["gemm_flops"]
        res["prefill"] = {"tokens": setup.prefill, "s": t, "flops": flops, "limit_s": limit, "ratio": limit / t}
        print(f"  prefill {setup.prefill}: {t * 1e3:8.2f} ms (limit {limit * 1e3:.2f} ms, {limit / t:.0%})")
    return res


def _empty_cache(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.empty_cache()


def _step_s(row: dict) -> tuple[float, str]:
    return (row["graph_step_s"], "graph") if row.get("graph_step_s") else (row["step_s"], "eager")


def bench_quantized(setup: Setup, name: str, cfg: dict, quant: str, batches: list[int], base: dict, work: Path,
                    deadline: float) -> dict:
    """Decode steps of `name` with `quantize { weights = QUANT_SCHEMES[quant] }` vs the bf16 run `base` of the
    same model (its streaming bandwidth for the limit, its step times for the tokens/s ratio)."""
    scheme = QUANT_SCHEMES[quant]
    Model, program = build_executor(f"{name}-{quant}", cfg, work, f"weights = {scheme}")
    weights = random_weights(program, setup.device)
    weight_bytes = step_bytes(program, weights, cfg.get("tie_embeddings") == "true")
    model = Model(weights, setup.device)
    kernels = sorted({n.attrs.get("kernel") for g in program.graphs.values() for _, n in g.items()
                      if n.op in ("linear_fp8", "linear_w4a16", "linear")})
    res = {"scheme": scheme, "weight_bytes_read_per_step": weight_bytes, "linear_kernels": kernels, "decode": []}
    print(f"{name} {scheme}: {weight_bytes / 1e9:.2f} GB read per step ({kernels})")
    base_rows = {r["batch"]: r for r in base.get("decode", [])}
    for bs in batches:
        if time.time() > deadline:
            print(f"  batch {bs}: skipped (time budget)")
            continue
        row = _decode_row(setup, model, cfg, bs, weight_bytes, base["stream_bandwidth"], profile=False)
        if bs in base_rows:
            (t_q, how_q), (t_b, how_b) = _step_s(row), _step_s(base_rows[bs])
            if how_q != how_b:  # compare like with like
                t_q, t_b, how_q = row["step_s"], base_rows[bs]["step_s"], "eager"
            row["speedup_vs_bf16"] = t_b / t_q
            row["speedup_timing"] = how_q
        res["decode"].append(row)
        _print_row(row)
        if "speedup_vs_bf16" in row:
            print(f"    tokens/s vs bf16: {row['speedup_vs_bf16']:.2f}x ({row['speedup_timing']})")
        _empty_cache(setup)
    return res


def kv_capacity(setup: Setup, name: str, cfg: dict, work: Path) -> dict:
    """KV tokens that fit in one byte budget, bf16 vs fp8 KV, sized as the runtime sizes its pool: the
    manifest's kv_cache section -> KVCacheConfig -> resolve_num_blocks(kv_cache_bytes=budget). The budget is
    what `kv_cache.memory_fraction` leaves of the device after the bf16 weights (CPU smoke: 1 GiB)."""
    from kiln.codegen.artifact import build_manifest
    from kiln.codegen.weights import total_weight_bytes
    from kiln.runtime.config import kv_cache_config_from_manifest
    from kiln.runtime.worker.memory_plan import resolve_num_blocks

    programs = {kv_name: compile_program(f"{name}-kv-{kv_name}", cfg, work, quantize)
                for kv_name, quantize in (("bf16", ""), ("fp8", "kv_cache = fp8"))}
    if setup.cuda:
        total = torch.cuda.get_device_properties(setup.device).total_memory
        budget = int(total * KV_MEMORY_FRACTION) - total_weight_bytes(programs["bf16"])
    else:
        budget = 2**30
    out = {"budget_bytes": budget}
    for kv_name, program in programs.items():
        manifest = build_manifest(program, kiln_version="bench", recipe_hash="0" * 64, max_model_len=8192,
                                  hf_config={}, gen_config={}, weight_files=[], has_tokenizer=False, pass_log=[])
        kv = kv_cache_config_from_manifest(manifest)
        blocks = resolve_num_blocks(kv, setup.device, kv_cache_bytes=budget)
        out[kv_name] = {"dtype": str(kv.dtype), "bytes_per_token": kv.bytes_per_block // kv.block_size,
                        "blocks": blocks, "tokens": blocks * kv.block_size}
    out["ratio"] = out["fp8"]["tokens"] / out["bf16"]["tokens"]
    print(f"{name} KV capacity in {budget / 2**30:.1f} GiB: bf16 {out['bf16']['tokens']:,} tokens, "
          f"fp8 {out['fp8']['tokens']:,} tokens ({out['ratio']:.2f}x)")
    return out


def _ceilings(setup: Setup, result: dict) -> None:
    result["copy_bandwidth"] = copy_bandwidth(setup)
    result["gemm_flops"] = gemm_peak(setup)
    print(f"{result['device']}: copy {result['copy_bandwidth'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {result['gemm_flops'] / 1e12:.0f} TFLOP/s")


def _run_quantized(setup: Setup, args, models: dict, result: dict, work: Path) -> None:
    quants = [q for q in args.quant.split(",") if q]
    unknown = [q for q in quants if q not in QUANT_SCHEMES]
    if unknown:
        raise SystemExit(f"--quant: unknown variant {unknown[0]!r} (known: {', '.join(QUANT_SCHEMES)})")
    if not quants:
        return
    name = QUANT_MODEL if QUANT_MODEL in models else next(iter(models))
    deadline = time.time() + args.quant_budget_s
    out = result.setdefault("quantized", {})
    try:
        out["kv_capacity"] = kv_capacity(setup, name, models[name], work)
    except Exception as e:
        import traceback

        traceback.print_exc()
        out["kv_capacity"] = {"error": f"{type(e).__name__}: {e}"}
    base = result["models"].get(name, {})
    if "stream_bandwidth" not in base:
        print(f"quantized decode skipped: no bf16 {name} run to compare with")
        return
    batches = [int(b) for b in args.quant_batches.split(",")]
    for quant in quants:
        if time.time() > deadline:
            print(f"{name} {quant}: skipped (quant time budget)")
            continue
        try:
            out[quant] = bench_quantized(setup, name, models[name], quant, batches, base, work, deadline)
        except Exception as e:
            import traceback

            traceback.print_exc()
            out[quant] = {"error": f"{type(e).__name__}: {e}"}
        _empty_cache(setup)
        _write(args, result)


def tuned_configs() -> dict:
    """The configs the Triton kernels' autotuning chose so far ({kernel key: config}), over every rendered
    kernels module imported in this process (empty with KILN_AUTOTUNE=0 or without a GPU)."""
    out: dict = {}
    for m in list(sys.modules.values()):
        fn = getattr(m, "tuned_configs", None)
        if callable(fn) and getattr(m, "__name__", "").endswith(".triton"):
            out.update(fn())
    return out


def _print_tuned(result: dict) -> None:
    tuned = result.get("autotune") or {}
    print(f"\nautotuned kernel configs ({len(tuned)}; KILN_AUTOTUNE=0 disables, KILN_AUTOTUNE_LOG=1 logs timings):")
    for key, cfg in sorted(tuned.items()):
        print(f"  {key}: {cfg}")


def _write(args, result: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["autotune"] = tuned_configs()
    (out / "gpu_decode.json").write_text(json.dumps(result, indent=2))


def _table(result: dict) -> None:
    print("\nmodel           batch   step ms   limit ms  of limit  GPU busy")
    for name, r in result["models"].items():
        for row in r.get("decode", []):
            busy = f"{row['gpu_busy']:.0%}" if row["gpu_busy"] is not None else "-"
            print(f"{name:15s} {row['batch']:5d} {row['step_s'] * 1e3:9.3f} {row['limit_s'] * 1e3:9.3f} "
                  f"{row['ratio']:8.0%}  {busy:>7s}")
        if r.get("prefill"):
            p = r["prefill"]
            print(f"{name:15s} pf{p['tokens']} {p['s'] * 1e3:9.2f} {p['limit_s'] * 1e3:9.2f} {p['ratio']:8.0%}")
        if "error" in r:
            print(f"{name:15s} ERROR {r['error']}")
    print("(step ms: eager decode; graph_step_s in the JSON: the same step replayed from a CUDA graph)")
    quant = result.get("quantized", {})
    if quant:
        print("\nquantized        batch  graph ms  eager ms  limit ms  of limit  vs bf16 tokens/s")
        for q, r in quant.items():
            if q == "kv_capacity":
                continue
            for row in r.get("decode", []):
                g = f"{row['graph_step_s'] * 1e3:9.3f}" if row["graph_step_s"] else f"{'-':>9s}"
                t = row["graph_step_s"] or row["step_s"]
                sp = f"{row['speedup_vs_bf16']:.2f}x ({row['speedup_timing']})" if "speedup_vs_bf16" in row else "-"
                print(f"{q:15s} {row['batch']:5d} {g} {row['step_s'] * 1e3:9.3f} {row['limit_s'] * 1e3:9.3f} "
                      f"{row['limit_s'] / t:8.0%}  {sp}")
            if "error" in r:
                print(f"{q:15s} ERROR {r['error']}")
        cap = quant.get("kv_capacity", {})
        if "ratio" in cap:
            print(f"fp8 KV: {cap['fp8']['tokens']:,} tokens vs bf16 {cap['bf16']['tokens']:,} "
                  f"in the same {cap['budget_bytes'] / 2**30:.1f} GiB -> {cap['ratio']:.2f}x")
        elif "error" in cap:
            print(f"fp8 KV capacity ERROR {cap['error']}")
    _print_tuned(result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop starting new bf16 measurements after this many seconds")
    ap.add_argument("--quant", default="fp8,int4",
                    help=f"quantized 8B variants measured after the bf16 runs, comma-separated, '' for none "
                         f"(known: {', '.join(f'{k}={v}' for k, v in QUANT_SCHEMES.items())})")
    ap.add_argument("--quant-batches", default="1,64")
    ap.add_argument("--quant-budget-s", type=float, default=60.0,
                    help="stop starting new quantized measurements this many seconds after they begin")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every code path on CPU (tiny model, short context, Triton interpreter): a check "
                         "that the script works, not a measurement")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the rendered kernels import triton
        setup = Setup(torch.device("cpu"), context=32, prefill=16, smoke=True)
        models = SMOKE_MODEL
        args.batches = args.batches if "--batches" in (argv or sys.argv) else "1,2"
        args.quant_batches = args.quant_batches if "--quant-batches" in (argv or sys.argv) else "1,2"
    elif not torch.cuda.is_available():
        print("gpu_decode: no CUDA device (torch.cuda.is_available() is False); nothing measured")
        return 0
    else:
        setup = Setup(torch.device("cuda"))
        models = {m: MODELS[m] for m in args.models.split(",")}
    deadline = time.time() + args.budget_s
    if setup.cuda:
        props = torch.cuda.get_device_properties(0)
        result = {"device": props.name, "sms": props.multi_processor_count}
    else:
        result = {"device": "cpu (--cpu-smoke: not a measurement)", "sms": None}
    result.update({"torch": torch.__version__, "cuda_graphs": setup.cuda, "models": {}})
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    _ceilings(setup, result)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in models.items():
            try:
                result["models"][name] = bench_model(setup, name, cfg, batches, result, Path(tmp), deadline)
                _empty_cache(setup)  # the model's weights go with bench_model's frame
            except Exception as e:
                import traceback

                traceback.print_exc()
                result["models"][name] = {"error": f"{type(e).__name__}: {e}"}
            _write(args, result)
        _run_quantized(setup, args, models, result, Path(tmp))
    _write(args, result)
    _table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
