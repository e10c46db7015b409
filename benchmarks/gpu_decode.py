"""Decode and prefill of kiln's h200 executor against their hardware limits, in one run on one GPU.

    python benchmarks/gpu_decode.py [--out DIR] [--models 1b,8b] [--batches 1,8,64,256] [--quick]

Measures, for Llama-3.2-1B and Llama-3-8B shapes with random bf16 weights (`weights = random(seed=0)`):
  * ceilings: device-to-device copy bandwidth; bf16 GEMM peak (8192^3 matmul);
  * the weight-streaming limit: a CUDA graph replaying one GEMV (F.linear at batch 1) over every weight matrix
    of the model, the same bytes a decode step must read -> achieved streaming bandwidth;
  * kiln's decode step (generated model.py + Triton kernels, eager, no CUDA graph) at each batch size with
    1K context per sequence: step time, its limit (weight bytes + KV bytes read, at the streaming bandwidth),
    ratio limit/measured, and GPU-busy fraction (kernel time from torch.profiler / wall time);
  * prefill of one 4K-token prompt: time vs FLOPs at the measured GEMM peak.
Writes DIR/gpu_decode.json and prints a table last. Without CUDA it says so and exits 0.
The executor is rendered from the compiled Program (codegen's render_model and kernel templates) and fed
weights made on the GPU, so no 16 GB artifact is written to disk; the code that runs is the artifact's.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MODELS = {
    "llama-3.2-1b": dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0,
                         tie_embeddings="true"),
    "llama-3-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0),
}
BLOCK = 16
CONTEXT = 1024
PREFILL = 4096


def _recipe(name: str, cfg: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in cfg.items())
    return (f"recipe bench_{name.replace('-', '_').replace('.', '_')} {{\n  model = llama({args})\n"
            f"  weights = random(seed=0)\n  target = h200\n  dtype = bf16\n"
            f"  kv_cache {{ block_size = {BLOCK} }}\n}}\n")


def build_executor(name: str, cfg: dict, work: Path):
    """Compiles the recipe (no weights written) and renders model.py + kernels into a package; returns
    (Model class, Program)."""
    from kiln.codegen.artifact import kernel_params
    from kiln.codegen.emitters import KERNEL_MODULES, TARGET_KERNEL_MODULES
    from kiln.codegen.render import render_model, template_env

    import kiln

    recipe = work / f"{name}.dsl"
    recipe.write_text(_recipe(name, cfg))
    program = kiln.compile(recipe, progress=False).program
    pkg = work / f"exec_{name.replace('-', '_').replace('.', '_')}"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "model.py").write_text(render_model(program, kiln_version="bench", recipe_hash="0" * 64,
                                               max_model_len=8192))
    params = kernel_params(program)
    env = template_env()
    for ns in TARGET_KERNEL_MODULES[params["target"]]:
        (pkg / "kernels" / f"{ns}.py").write_text(env.get_template(KERNEL_MODULES[ns][0]).render(
            kiln_version="bench", **params))
    sys.path.insert(0, str(work))
    try:
        module = importlib.import_module(f"{pkg.name}.model")
    finally:
        sys.path.remove(str(work))
    return module.Model, program


def random_weights(program, device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for spec in program.params.values():
        names = [spec.layer_name(i) for i in range(program.blocks[spec.block].count)] if spec.block else [spec.name]
        for n in names:
            if len(spec.shape) == 1:  # norm weights
                out[n] = torch.ones(spec.shape, dtype=torch.bfloat16, device=device)
            else:
                out[n] = (torch.randn(spec.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return out


def matrices(weights: dict[str, torch.Tensor], tied: bool) -> list[torch.Tensor]:
    """The matrices one decode step reads: every 2-D weight except the embedding table (rows are gathered),
    which is read whole only as a tied LM head."""
    mats = [w for n, w in weights.items() if w.dim() == 2 and not n.endswith("embed")]
    if tied:
        mats += [w for n, w in weights.items() if n.endswith("embed")]
    return mats


def cuda_time(fn, warmup=3, iters=10) -> float:
    """Median seconds per call, CUDA events."""
    for _ in range(warmup):
        fn()
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


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / t


def gemm_peak() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, iters=20)
    return 2 * n**3 / t


def streaming_limit(mats: list[torch.Tensor]) -> tuple[float, float]:
    """(seconds, bytes/s) of a CUDA graph of one batch-1 GEMV per weight matrix."""
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in {m.shape[1] for m in mats}}
    nbytes = sum(m.numel() * m.element_size() for m in mats)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m in mats:
            F.linear(xs[m.shape[1]], m)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in mats:
            F.linear(xs[m.shape[1]], m)
    t = cuda_time(graph.replay, iters=20)
    return t, nbytes / t


def decode_batch(batch_size: int, context: int, layers_kv: int, kv_heads: int, head_dim: int, device):
    from kiln.runtime.forward_batch import ForwardBatch

    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch_size * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    tables = perm.view(batch_size, blocks_per_seq).to(torch.int32)
    pos = context - 1
    slots = tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
    i32 = dict(dtype=torch.int32, device=device)
    fb = ForwardBatch(input_ids=torch.randint(0, 1000, (batch_size,), **i32),
                      positions=torch.full((batch_size,), pos, **i32),
                      query_start_loc=torch.arange(batch_size + 1, **i32),
                      seq_lens=torch.full((batch_size,), context, **i32),
                      block_tables=tables.to(device), slot_mapping=slots.to(device),
                      logits_indices=torch.arange(batch_size, **i32), num_decodes=batch_size)
    kv = [torch.randn(num_blocks, 2, BLOCK, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
          for _ in range(layers_kv)]
    return fb, kv


def prefill_batch(tokens: int, layers_kv: int, kv_heads: int, head_dim: int, device):
    from kiln.runtime.forward_batch import ForwardBatch

    nb = math.ceil(tokens / BLOCK)
    i32 = dict(dtype=torch.int32, device=device)
    fb = ForwardBatch(input_ids=torch.randint(0, 1000, (tokens,), **i32), positions=torch.arange(tokens, **i32),
                      query_start_loc=torch.tensor([0, tokens], **i32), seq_lens=torch.tensor([tokens], **i32),
                      block_tables=torch.arange(nb, **i32)[None], slot_mapping=torch.arange(tokens, device=device),
                      logits_indices=torch.tensor([tokens - 1], **i32), num_decodes=0)
    kv = [torch.zeros(nb, 2, BLOCK, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
          for _ in range(layers_kv)]
    return fb, kv


def busy_fraction(fn) -> float | None:
    """Sum of GPU kernel time / wall time over 5 calls, by torch.profiler (None if the profiler fails)."""
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


def graph_time(model, fb, kv, dev) -> float | None:
    """Seconds per decode step replayed from a CUDA graph (CUDAGraphRunner, one bucket = this batch; the
    copy into its static buffers included). Block 0 is unused by decode_batch: it is the scratch block."""
    from kiln.runtime.graph_runner import CUDAGraphRunner

    try:
        runner = CUDAGraphRunner(model, kv, [fb.num_seqs], fb.block_tables.shape[1], BLOCK, scratch_block=0,
                                 device=dev)
        runner.capture()
        return cuda_time(functools.partial(runner.run, fb))
    except Exception as e:  # report, keep measuring the eager path
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {e})")
        return None


def bench_model(name: str, cfg: dict, batches: list[int], ceilings: dict, work: Path, deadline: float) -> dict:
    dev = torch.device("cuda")
    Model, program = build_executor(name, cfg, work)
    weights = random_weights(program, dev)
    tied = cfg.get("tie_embeddings") == "true"
    mats = matrices(weights, tied)
    weight_bytes = sum(m.numel() * m.element_size() for m in mats)
    t_stream, bw_stream = streaming_limit(mats)
    model = Model(weights, dev)
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
        fb, kv = decode_batch(bs, CONTEXT, layers, kvh, head_dim, dev)
        step = functools.partial(model.forward, fb, kv)
        t = cuda_time(step)
        kv_bytes = bs * CONTEXT * layers * 2 * kvh * head_dim * 2
        limit = (weight_bytes + kv_bytes) / bw_stream
        busy = busy_fraction(step) if bs in (1, 64) else None
        t_graph = graph_time(model, fb, kv, dev)
        row = {"batch": bs, "context": CONTEXT, "step_s": t, "limit_s": limit, "ratio": limit / t,
               "tokens_per_s": bs / t, "gpu_busy": busy, "graph_step_s": t_graph}
        res["decode"].append(row)
        print(f"  decode b={bs:4d}: {t * 1e3:8.3f} ms (limit {limit * 1e3:.3f} ms, {limit / t:.0%})"
              + (f", GPU busy {busy:.0%}" if busy is not None else "")
              + (f"; CUDA graph {t_graph * 1e3:.3f} ms" if t_graph is not None else ""))
        del kv, fb, step
        torch.cuda.empty_cache()
    if time.time() < deadline:
        fb, kv = prefill_batch(PREFILL, layers, kvh, head_dim, dev)
        t = cuda_time(functools.partial(model.forward, fb, kv), warmup=2, iters=5)
        # layer GEMMs over every token (the LM head runs on the last token only: left out)
        n_params = sum(w.numel() for n, w in weights.items() if w.dim() == 2 and not n.endswith(("embed", "lm_head")))
        flops = 2 * n_params * PREFILL
        flops += layers * 2 * 2 * cfg["heads"] * head_dim * PREFILL * PREFILL / 2  # causal QK^T + PV
        limit = flops / ceilings["gemm_flops"]
        res["prefill"] = {"tokens": PREFILL, "s": t, "flops": flops, "limit_s": limit, "ratio": limit / t}
        print(f"  prefill {PREFILL}: {t * 1e3:8.2f} ms (limit {limit * 1e3:.2f} ms, {limit / t:.0%})")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new measurements after this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device (torch.cuda.is_available() is False); nothing measured")
        return 0
    deadline = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "cuda_graphs": True, "models": {}}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    result["copy_bandwidth"] = copy_bandwidth()
    result["gemm_flops"] = gemm_peak()
    print(f"{props.name}: copy {result['copy_bandwidth'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {result['gemm_flops'] / 1e12:.0f} TFLOP/s")
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                result["models"][name] = bench_model(name, MODELS[name], batches, result, Path(tmp), deadline)
                torch.cuda.empty_cache()  # the model's weights go with bench_model's frame
            except Exception as e:
                import traceback

                traceback.print_exc()
                result["models"][name] = {"error": f"{type(e).__name__}: {e}"}
            (out / "gpu_decode.json").write_text(json.dumps(result, indent=2))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
