"""The real engine (LLMEngine over the h200 executor, CUDA graphs) in steady decode, and its memory plan.

    python benchmarks/gpu_engine.py [--out DIR] [--models llama-3.2-1b,llama-3-8b] [--batches 1,64] [--steps 64]
    python benchmarks/gpu_engine.py --cpu-smoke     # the same code on the cpu target: a tiny model, seconds

For Llama-3.2-1B and Llama-3-8B shapes with random bf16 weights (`weights = random(seed=0)`), the recipe is
compiled for h200 (every pass, fuse_rope_kv_write included) and its model.py and Triton kernels rendered into
a package as an artifact would hold them; the weights are made on the GPU, so no 16 GB artifact is written.
`LLMEngine` loads that in-memory artifact (KV pool sized by the runtime from free device memory, decode graphs
captured for the batch buckets), then for each batch size B:
  * B requests of CONTEXT random prompt tokens are prefilled, then the engine runs `--warmup` decode steps;
  * steady decode: `--steps` engine steps (schedule, CUDA-graph replay, sample, update, outputs) timed by the
    wall clock -> step time and tokens/s, against the step's limit: the matrices a decode step reads plus the
    KV of its context, at the bandwidth gpu_decode.py's GEMV loop measures over those matrices in this run;
  * GPU busy: over `--profile-steps` more steps under torch.profiler (CUDA activity only), the union of the
    kernel intervals / the wall time of those steps (the issue's bar: >= 95%); idle gaps are host time. Without
    the profiler: the bucket's decode graph replayed back to back (the model's GPU time per step) / step time;
  * at B = 1, the top 10 kernels by GPU time with their share of the step, so the next session knows where
    decode time goes;
  * all of it twice, on the same engine: async scheduling on (rows in "decode": step N+1 launched before step
    N's tokens are read back) and off (rows in "decode_sync"), so one run shows what the overlap buys. Each
    measurement starts only inside `--budget-s`.
Memory plan: what `kiln compile --report` predicts (weights, KV pool bytes and tokens for the datasheet memory
and, for comparison, for the device's measured memory; decode-graph memory from the cuda_graph_plan pass;
prefill activations at max_batched_tokens from the same per-token rule) against what the load measured
(torch.cuda.memory_allocated around the weights, the KV tensors the runner allocated and their block count,
the graph pool the capture took, the peak over the prefill steps, and the activation peak the load's memory
plan measured with a dummy max_batched_tokens prefill before sizing the KV pool).
Writes DIR/gpu_engine.json (after every model) and prints the tables last. Without CUDA (and no --cpu-smoke)
it says so and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode  # noqa: E402  (executor rendering, random weights, the GEMV-loop streaming limit)

MODELS = {
    "llama-3.2-1b": dict(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0,
                         tie_embeddings="true"),
    "llama-3-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0),
}
SMOKE_MODELS = {"tiny": dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, rope_theta=10000.0)}
BLOCK = 16
MEMORY_FRACTION = 0.9
TOP_KERNELS = 10


@dataclass
class Setup:
    """What differs between the H200 run and --cpu-smoke."""

    device: torch.device
    target: str
    dtype: str  # the recipe's activation and weight dtype
    context: int
    steps: int
    warmup: int
    profile_steps: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def recipe_text(name: str, cfg: dict, target: str, dtype: str, batches: list[int]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in cfg.items())
    graphs = f"  cuda_graphs {{ batch_sizes = [{', '.join(map(str, batches))}] }}\n" if target != "cpu" else ""
    return (f"recipe bench_{name.replace('-', '_').replace('.', '_')} {{\n  model = llama({args})\n"
            f"  weights = random(seed=0)\n  target = {target}\n  dtype = {dtype}\n"
            f"  kv_cache {{ block_size = {BLOCK}; memory_fraction = {MEMORY_FRACTION} }}\n"
            f"  scheduler {{ max_seqs = {max(batches)} }}\n{graphs}}}\n")


def _allocated(setup: Setup) -> int:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
        return torch.cuda.memory_allocated(setup.device)
    return 0


def load_engine(setup: Setup, name: str, cfg: dict, batches: list[int], work: Path):
    """Compiles the recipe, renders its executor package, builds the weights on the device and starts an
    LLMEngine on the in-memory artifact. Returns (engine, program, pass_log, measured-memory dict)."""
    from kiln.codegen.artifact import build_manifest, resolve_max_model_len
    from kiln.runtime.artifact import LoadedArtifact
    from kiln.runtime.config import (
        cuda_graph_config_from_manifest,
        kv_cache_config_from_manifest,
        model_config_from_manifest,
        scheduler_config_from_manifest,
    )
    from kiln.runtime.llm_engine import LLMEngine

    import kiln

    tag = name.replace("-", "_").replace(".", "_")
    recipe = work / f"{tag}.dsl"
    recipe.write_text(recipe_text(name, cfg, setup.target, setup.dtype, batches))
    res = kiln.compile(recipe, progress=False)
    program = res.program
    max_len = resolve_max_model_len(program, None, {})
    pkg, model_cls = gpu_decode.render_executor(program, work, f"engine_{tag}", max_len)
    manifest = build_manifest(program, kiln_version="bench", recipe_hash="0" * 64, max_model_len=max_len,
                              hf_config={}, gen_config={}, weight_files=[], has_tokenizer=False,
                              pass_log=res.pass_log)

    if setup.cuda:
        torch.cuda.empty_cache()
    before = _allocated(setup)
    weights = gpu_decode.random_weights(program, setup.device)
    model = model_cls(weights, setup.device)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    after_weights = _allocated(setup)
    # the weight-streaming limit of a step: gpu_decode.py's GEMV loop over the matrices a decode step reads
    mats = gpu_decode.matrices(weights, tied=cfg.get("tie_embeddings") == "true")
    step_weight_bytes = sum(m.numel() * m.element_size() for m in mats)
    gemv = mats if setup.dtype == "bf16" else [m.bfloat16() for m in mats]  # the helper's GEMVs are bf16
    _, bandwidth = gpu_decode.streaming_limit(gpu_decode.Setup(device=setup.device, smoke=not setup.cuda), gemv)
    del weights, mats, gemv  # the model holds the weights
    art = LoadedArtifact(path=pkg, manifest=manifest, model=model, tokenizer=None, device=setup.device,
                         model_config=model_config_from_manifest(manifest),
                         kv_cache_config=kv_cache_config_from_manifest(manifest),
                         scheduler_config=scheduler_config_from_manifest(manifest),
                         cuda_graph_config=cuda_graph_config_from_manifest(manifest))
    t0 = time.perf_counter()
    engine = LLMEngine(art, device=setup.device)
    load_s = time.perf_counter() - t0
    runner = engine.runner
    kv = art.kv_cache_config
    measured = {
        "weights_bytes": weight_bytes,
        "weights_allocated_bytes": (after_weights - before) if setup.cuda else None,
        "kv_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
        "kv_blocks": runner.num_blocks,
        "kv_tokens": runner.num_blocks * kv.block_size,
        "graphs_bytes": runner.graph_runner.memory_bytes if runner.graph_runner is not None else None,
        "memory_plan": dict(getattr(runner, "memory_plan", None) or {}),  # what the KV pool was sized from
        "allocated_after_load_bytes": _allocated(setup) if setup.cuda else None,
        "device_total_bytes": torch.cuda.mem_get_info(setup.device)[1] if setup.cuda else None,
        "engine_init_s": load_s,
        "step_weight_bytes": step_weight_bytes,
        "stream_bandwidth": bandwidth,
    }
    return engine, program, res.pass_log, measured


def predicted_plan(program, setup: Setup, device_total: int | None) -> dict:
    """What `kiln compile --report` (compiler.report.capacity) and the cuda_graph_plan pass predict."""
    from kiln.compiler.kv_layout import step_activation_bytes
    from kiln.compiler.options import CUDA_GRAPH_PLAN, RecipeOptions
    from kiln.compiler.report import capacity
    from kiln.compiler.targets import get_target

    target = get_target(setup.target)
    cap = capacity(program, target, memory_fraction=MEMORY_FRACTION)
    plan = {"weights_bytes": cap.param_bytes, "kv_pool_bytes": cap.kv_pool_bytes, "kv_tokens": cap.kv_tokens,
            "kv_bytes_per_token": cap.kv_bytes_per_token, "datasheet_memory_bytes": cap.memory_bytes}
    if device_total:
        pool = max(0, int(device_total * MEMORY_FRACTION) - cap.param_bytes)
        plan["kv_tokens_at_device_memory"] = pool // cap.kv_bytes_per_token
        plan["kv_pool_bytes_at_device_memory"] = pool
    graphs = program.meta.get(CUDA_GRAPH_PLAN) or {}
    plan["graphs_bytes"] = graphs.get("estimated_bytes")
    max_tokens = RecipeOptions.from_meta(program.meta).scheduler.max_batched_tokens
    plan["prefill_activations_bytes"] = step_activation_bytes(program, max_tokens)
    plan["prefill_tokens"] = max_tokens
    return plan


def _sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _profile(setup: Setup, step, n: int) -> dict:
    """n steps under torch.profiler: GPU busy fraction (kernel-interval union / wall) and kernel totals.
    On CPU (smoke) the ops' self CPU time stands in for kernels and busy is not defined."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if setup.cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _sync(setup)
        wall = time.perf_counter() - t0
    if setup.cuda:
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in events])
        totals: dict[str, float] = {}
        for e in events:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
        kernel_us = sum(totals.values())
        busy = busy_us / 1e6 / wall if events else None
    else:
        totals = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        kernel_us, busy = sum(totals.values()), None
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"profiled_steps": n, "profiled_wall_s": wall, "gpu_busy": busy,
            "kernel_s_per_step": kernel_us / 1e6 / n,
            "top_kernels": [{"name": k, "us_per_step": v / n, "share": v / kernel_us if kernel_us else None}
                            for k, v in top]}


def graph_replay_s(setup: Setup, engine, batch: int) -> float | None:
    """Seconds of one replay of the decode graph serving `batch` sequences, replays back to back (CUDA events,
    median of 20): the model's GPU time per step without any host work between steps. The replay repeats the
    last step on the graph's static buffers (same tokens, same slots), so no sequence's state changes."""
    runner = engine.runner.graph_runner
    if not setup.cuda or runner is None or not runner.graphs:
        return None
    graph = runner.graphs.get(runner.bucket_for(batch))
    if graph is None:
        return None
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def steady_decode(setup: Setup, engine, batch: int, vocab: int, seed: int, profile_kernels: bool,
                  measured: dict) -> dict:
    """B requests prefilled, then --warmup, --steps timed and --profile-steps profiled decode steps."""
    from kiln.runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    total = setup.warmup + setup.steps + setup.profile_steps + 4
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(10, vocab, (setup.context,), generator=g).tolist(), params)
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats(setup.device)
    base = _allocated(setup)
    produced: dict[str, int] = {}
    t0 = time.perf_counter()
    while len(produced) < batch or min(produced.values()) < 1:  # every request prefilled and sampled once
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    _sync(setup)
    prefill_s = time.perf_counter() - t0
    prefill_peak = (torch.cuda.max_memory_allocated(setup.device) - base) if setup.cuda else None
    for _ in range(setup.warmup):
        engine.step()
    _sync(setup)
    t0 = time.perf_counter()
    for _ in range(setup.steps):
        engine.step()
    _sync(setup)
    wall = time.perf_counter() - t0
    assert len(engine.scheduler.running) == batch, (
        f"{len(engine.scheduler.running)} running, expected {batch}: not a steady decode batch")
    # the limit of a step: its weights plus the KV it reads (mid-window context) at the streaming bandwidth
    kv = engine.runner.kv_caches
    kv_per_token = sum(t[0].numel() * t.element_size() for t in kv) // engine.runner.block_size
    context = setup.context + setup.warmup + setup.steps // 2
    limit = (measured["step_weight_bytes"] + batch * context * kv_per_token) / measured["stream_bandwidth"]
    step_s = wall / setup.steps
    row = {"batch": batch, "context": setup.context, "steps": setup.steps, "step_s": step_s,
           "tokens_per_s": batch * setup.steps / wall, "limit_s": limit, "ratio": limit / step_s,
           "prefill_s": prefill_s, "prefill_peak_activation_bytes": prefill_peak}
    graph_s = graph_replay_s(setup, engine, batch)
    if graph_s is not None:  # a profiler-free view of the same question: GPU time of the model per engine step
        row["graph_replay_s"], row["graph_share_of_step"] = graph_s, graph_s / step_s
    if setup.profile_steps:
        try:
            prof = _profile(setup, engine.step, setup.profile_steps)
        except Exception as e:  # the profiler needs CUPTI; report the gap, keep the timings
            prof = {"gpu_busy": None, "profile_error": f"{type(e).__name__}: {e}"}
        if not profile_kernels:
            prof.pop("top_kernels", None)
        row.update(prof)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def bench_model(setup: Setup, name: str, cfg: dict, batches: list[int], work: Path, deadline: float) -> dict:
    engine, program, pass_log, measured = load_engine(setup, name, cfg, batches, work)
    fused = next((r.get("stats", {}).get("matches") for r in pass_log if r["name"] == "fuse_rope_kv_write"), None)
    res = {"predicted": predicted_plan(program, setup, measured["device_total_bytes"]), "measured": measured,
           "fuse_rope_kv_write_matches": fused, "cuda_graphs": engine.runner.graph_runner is not None,
           "decode": []}
    print(f"{name}: engine up in {measured['engine_init_s']:.1f} s; {measured['kv_blocks']} KV blocks "
          f"({measured['kv_tokens']:,} tokens); graphs {'on' if res['cuda_graphs'] else 'off'}")
    res["decode_sync"] = []
    for k, bs in enumerate(batches):
        # async scheduling on (rows in "decode"), then off ("decode_sync"): the same engine, batch and steps
        for flag, rows in ((True, res["decode"]), (False, res["decode_sync"])):
            mode = "async" if flag else "sync"
            if time.time() > deadline:
                print(f"  batch {bs} {mode}: skipped (time budget)")
                continue
            engine.async_scheduling = flag
            row = steady_decode(setup, engine, bs, cfg["vocab"], seed=k, profile_kernels=(bs == 1 and flag),
                                measured=measured)
            row["async_scheduling"] = flag
            rows.append(row)
            busy = row.get("gpu_busy")
            print(f"  decode b={bs:4d} {mode:>5}: {row['step_s'] * 1e3:8.3f} ms/step, {row['tokens_per_s']:10.1f} "
                  f"tok/s, {row['ratio']:.0%} of the streaming limit"
                  + (f", GPU busy {busy:.1%}" if busy is not None else ""))
    res["measured"]["prefill_peak_activation_bytes"] = max(
        (r["prefill_peak_activation_bytes"] or 0 for r in res["decode"] + res["decode_sync"]), default=None)
    return res


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:8.3f} GB"


def tables(result: dict) -> str:
    lines = ["", "steady decode (LLMEngine.step, CUDA graphs on GPU; async scheduling on, then off)",
             f"{'model':<15} {'batch':>5} {'async':>5} {'step ms':>9} {'tok/s':>10} {'limit ms':>9} {'of limit':>8} "
             f"{'GPU busy':>9} {'kernel ms':>10} {'graph ms':>9}"]
    for name, r in result["models"].items():
        rows = sorted(r.get("decode", []) + r.get("decode_sync", []),
                      key=lambda row: (row["batch"], not row.get("async_scheduling", False)))
        for row in rows:
            busy = "-" if row.get("gpu_busy") is None else f"{row['gpu_busy']:.1%}"
            kern = "-" if row.get("kernel_s_per_step") is None else f"{row['kernel_s_per_step'] * 1e3:.3f}"
            graph = "-" if row.get("graph_replay_s") is None else f"{row['graph_replay_s'] * 1e3:.3f}"
            mode = "on" if row.get("async_scheduling") else "off"
            lines.append(f"{name:<15} {row['batch']:5d} {mode:>5} {row['step_s'] * 1e3:9.3f} "
                         f"{row['tokens_per_s']:10.1f} {row['limit_s'] * 1e3:9.3f} {row['ratio']:8.0%} {busy:>9} "
                         f"{kern:>10} {graph:>9}")
        if "error" in r:
            lines.append(f"{name:<15} ERROR {r['error']}")
    for name, r in result["models"].items():
        for row in r.get("decode", []):
            if row.get("top_kernels"):
                lines += ["", f"{name}, batch {row['batch']}: top kernels by GPU time per step"]
                for k in row["top_kernels"]:
                    share = "-" if k["share"] is None else f"{k['share']:.1%}"
                    lines.append(f"  {k['us_per_step']:9.1f} us {share:>6}  {k['name'][:90]}")
    for name, r in result["models"].items():
        if "predicted" not in r:
            continue
        p, m = r["predicted"], r["measured"]
        lines += ["", f"{name}: memory plan, --report prediction vs the engine's load",
                  f"  {'':<28} {'predicted':>14} {'measured':>14}",
                  f"  {'weights':<28} {_gb(p['weights_bytes']):>14} {_gb(m['weights_allocated_bytes'] or m['weights_bytes']):>14}",
                  f"  {'KV pool (datasheet memory)':<28} {_gb(p['kv_pool_bytes']):>14} {_gb(m['kv_bytes']):>14}",
                  f"  {'KV tokens (datasheet memory)':<28} {p['kv_tokens']:>14,} {m['kv_tokens']:>14,}"]
        if "kv_tokens_at_device_memory" in p:
            lines.append(f"  {'KV tokens (device memory)':<28} {p['kv_tokens_at_device_memory']:>14,} "
                         f"{m['kv_tokens']:>14,}")
        lines += [f"  {'decode graphs':<28} {_gb(p['graphs_bytes']):>14} {_gb(m['graphs_bytes']):>14}",
                  f"  {'prefill activations':<28} {_gb(p['prefill_activations_bytes']):>14} "
                  f"{_gb(m.get('prefill_peak_activation_bytes')):>14}"
                  f"  (predicted: {p['prefill_tokens']} tokens x per-token values; measured: peak over prefill)"]
        plan = m.get("memory_plan") or {}
        lines.append(f"  {'activation peak (load plan)':<28} {_gb(p['prefill_activations_bytes']):>14} "
                     f"{_gb(plan.get('activation_peak')):>14}"
                     f"  (measured: the load's dummy max_batched_tokens prefill; plan: {plan.get('source', '-')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=70.0, help="stop starting new measurements after this")
    ap.add_argument("--cpu-smoke", action="store_true", help="cpu target, a tiny model, few steps")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.cpu_smoke:
        setup = Setup(torch.device("cpu"), "cpu", "fp32", context=12, steps=3, warmup=1, profile_steps=2)
        models, batches = SMOKE_MODELS, [1, 3]
    else:
        if not torch.cuda.is_available():
            print("gpu_engine: no CUDA device (torch.cuda.is_available() is False); nothing measured")
            return 0
        setup = Setup(torch.device("cuda"), "h200", "bf16", args.context, args.steps, args.warmup,
                      args.profile_steps)
        models = {m: MODELS[m] for m in args.models.split(",")}
    deadline = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"target": setup.target, "torch": torch.__version__, "models": {}}
    if setup.cuda:
        result["device"] = torch.cuda.get_device_properties(0).name
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in models.items():
            if time.time() > deadline:
                result["models"][name] = {"error": "skipped (time budget)"}
                continue
            try:
                result["models"][name] = bench_model(setup, name, cfg, batches, Path(tmp), deadline)
            except Exception as e:  # record and go on to the next model
                import traceback

                traceback.print_exc()
                result["models"][name] = {"error": f"{type(e).__name__}: {e}"}
            gc.collect()  # the engine (KV pool, graph pool) goes before the next model allocates its own
            if setup.cuda:
                torch.cuda.empty_cache()
            (out / "gpu_engine.json").write_text(json.dumps(result, indent=2))
    print(tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
