"""The engine's own CPU time per decode step at 1, 64 and 256 running sequences, phase by phase.

The executor is `kiln.bench.InstantModel` (precomputed logits, no model math), so every microsecond is the
engine's: schedule, build the ForwardBatch, sample, update, stop checks + detokenize + outputs. With
`--baseline REV` the same measurement runs on the runtime of git revision REV too, alternating
baseline/current runs in fresh processes (ABAB...) so that a noisy, shared machine hits both alike.

    python benchmarks/engine_overhead.py --baseline HEAD --repeats 3 --torch-threads 1 --json out.json
    python benchmarks/engine_overhead.py --async-scheduling both --torch-threads 1   # overlap off vs on

`--async-scheduling on` runs the engine with async scheduling forced on (`both`: off and on, alternating, like
a baseline). On CPU nothing overlaps (torch is synchronous), so this shows only the bookkeeping's cost; the
phase rows are still those of the synchronous step (the async step interleaves them), the `step` row is
`LLMEngine.step()` as configured. `--async-scheduling both --interleaved` instead builds both engines in one
process and alternates `--repeats` rounds of `--steps` plain steps between them (so load from other
processes hits both alike), printing each mode's best and median round.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import REPO, ensure_artifact  # noqa: E402

PHASES = ("schedule", "prepare", "execute", "sample", "update", "process")


def _use_runtime(runtime_dir: Path) -> None:
    """Makes `kiln.runtime` the package in `runtime_dir` (a checkout of another revision's runtime/)."""
    spec = importlib.util.spec_from_file_location("kiln.runtime", runtime_dir / "__init__.py",
                                                  submodule_search_locations=[str(runtime_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kiln.runtime"] = module
    spec.loader.exec_module(module)


def _force_async_scheduling() -> None:
    """Every LLMEngine the measurement builds gets async_scheduling=True; its phase-by-phase steps (which call
    the synchronous step's parts directly) first read back the step in flight and run with it off."""
    from kiln.runtime.llm_engine import LLMEngine

    import kiln.bench as bench

    init, timed_step = LLMEngine.__init__, bench._timed_step

    def async_init(self, *a, **kw):
        kw.setdefault("async_scheduling", True)
        init(self, *a, **kw)

    def sync_timed_step(engine, clock):
        engine.async_scheduling = False
        while engine._inflight is not None:
            engine.step()
        try:
            return timed_step(engine, clock)
        finally:
            engine.async_scheduling = True

    LLMEngine.__init__ = async_init
    bench._timed_step = sync_timed_step


def _interleaved(artifact: Path, args: argparse.Namespace) -> dict:
    """Sync and async engines side by side in this process, rounds alternating; µs per step."""
    import random

    import torch
    from kiln.runtime.core.batch import cdiv
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    from kiln.bench import InstantModel

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    out: dict = {}
    for n in (int(x) for x in args.batch_sizes.split(",")):
        engines = {}
        for mode in (False, True):
            engine = LLMEngine(artifact, num_kv_blocks=1, async_scheduling=mode)
            max_len, vocab = engine.model_config.max_model_len, engine.model_config.vocab_size
            needed = min(max_len, 32 + (args.repeats + 2) * args.steps + 16)
            engine = LLMEngine(artifact, num_kv_blocks=n * cdiv(needed, engine.block_manager.block_size) + 8,
                               max_num_seqs=n, max_num_batched_tokens=max(8192, n * 32), async_scheduling=mode)
            engine.runner.model = InstantModel(vocab, max_rows=n + 1)
            rng = random.Random(0)
            params = SamplingParams(max_tokens=needed - 32, ignore_eos=True, temperature=args.temperature)
            for i in range(n):
                engine.add_request(f"r{i}", [rng.randrange(min(8, vocab - 1), vocab) for _ in range(32)], params)
            for _ in range(10):
                engine.step()
            engines["async" if mode else "sync"] = engine
        rounds: dict[str, list[float]] = {m: [] for m in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                rounds[mode].append((time.perf_counter() - t0) / args.steps * 1e6)
            assert all(len(e.scheduler.running) == n for e in engines.values()), "a sequence finished early"
        out[str(n)] = {m: {"best_us": min(r), "median_us": statistics.median(r), "rounds_us": r}
                       for m, r in rounds.items()}
        print(f"B={n}: step µs best / median, sync {out[str(n)]['sync']['best_us']:.0f} / "
              f"{out[str(n)]['sync']['median_us']:.0f} -> async {out[str(n)]['async']['best_us']:.0f} / "
              f"{out[str(n)]['async']['median_us']:.0f}")
    return out


def _child(args: argparse.Namespace) -> None:
    if args.runtime_dir:
        _use_runtime(Path(args.runtime_dir))
    if args.async_scheduling == "on":
        _force_async_scheduling()
    from kiln.bench import run_engine_overhead

    result = run_engine_overhead(args.artifact, batch_sizes=tuple(int(x) for x in args.batch_sizes.split(",")),
                                 steps=args.steps, temperature=args.temperature, torch_threads=args.torch_threads)
    print(json.dumps(result))


def _run_once(artifact: Path, runtime_dir: Path | None, args: argparse.Namespace, async_scheduling: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--artifact", str(artifact), "--batch-sizes", args.batch_sizes,
           "--steps", str(args.steps), "--temperature", str(args.temperature),
           "--async-scheduling", async_scheduling]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    if runtime_dir:
        cmd += ["--runtime-dir", str(runtime_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _aggregate(runs: list[dict]) -> dict:
    """Per batch size: the median over runs of each phase's mean/p50/p90, and the step's spread."""
    out = {}
    for size in runs[0]["batch_sizes"]:
        per = [r["batch_sizes"][size] for r in runs]
        phases = {p: {k: statistics.median(r["phases_us"][p][k] for r in per) for k in ("mean", "p50", "p90")}
                  for p in PHASES}
        step_means = [r["step_us"]["mean"] for r in per]
        out[size] = {"phases_us": phases,
                     "step_us": {k: statistics.median(r["step_us"][k] for r in per) for k in ("mean", "p50", "p90")},
                     "step_mean_us_min_max": [min(step_means), max(step_means)],
                     "steps_per_s": statistics.median(r["steps_per_s"] for r in per)}
    return out


def _table(title: str, agg: dict) -> str:
    lines = [title, f"{'phase (µs)':<12}" + "".join(f"{'B=' + s + ' mean/p50/p90':>26}" for s in agg)]
    for p in (*PHASES, "step"):
        cells = [agg[s]["phases_us"][p] if p != "step" else agg[s]["step_us"] for s in agg]
        lines.append(f"{p:<12}" + "".join(f"{c['mean']:>10.0f}{c['p50']:>8.0f}{c['p90']:>8.0f}" for c in cells))
    lines.append(f"{'steps/s':<12}" + "".join(f"{agg[s]['steps_per_s']:>26.0f}" for s in agg))
    spans = [agg[s]["step_mean_us_min_max"] for s in agg]
    lines.append(f"{'step mean range':<12}" + "".join(f"{f'{lo:.0f}..{hi:.0f}':>26}" for lo, hi in spans))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", help="artifact dir (default: embedded model if present, else a tiny Llama)")
    ap.add_argument("--baseline", help="git revision whose runtime/ to measure alongside the working tree")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--torch-threads", type=int)
    ap.add_argument("--async-scheduling", choices=("off", "on", "both"), default="off",
                    help="measure with async scheduling off (default), forced on, or both (alternating)")
    ap.add_argument("--interleaved", action="store_true",
                    help="with --async-scheduling both: both engines in this process, rounds alternating")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runtime-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)

    if args.baseline and args.async_scheduling == "both":
        ap.error("--async-scheduling both compares two modes of the working tree; drop --baseline")
    if args.interleaved and args.async_scheduling != "both":
        ap.error("--interleaved compares the two async-scheduling modes: add --async-scheduling both")
    name, artifact = (args.artifact, Path(args.artifact)) if args.artifact else ensure_artifact()
    if args.interleaved:
        report = {"artifact": name, "steps": args.steps, "repeats": args.repeats, "temperature": args.temperature,
                  "torch_threads": args.torch_threads, "interleaved": _interleaved(artifact, args)}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return None
    variants: dict[str, Path | None] = {"current": None}
    modes = {"current": args.async_scheduling}
    if args.async_scheduling == "both":
        variants, modes = {"sync": None, "async": None}, {"sync": "off", "async": "on"}
    tmp = None
    if args.baseline:
        tmp = tempfile.TemporaryDirectory(prefix="kiln-baseline-")
        archive = subprocess.run(["git", "archive", args.baseline, "runtime"], check=True, capture_output=True,
                                 cwd=REPO).stdout
        tar_path = Path(tmp.name) / "runtime.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp.name, filter="data")
        variants = {"baseline": Path(tmp.name) / "runtime", "current": None}
        modes = {"baseline": "off", "current": args.async_scheduling}  # an older runtime may not have it
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.repeats):
        for variant, runtime_dir in variants.items():
            print(f"run {i + 1}/{args.repeats} {variant} ...", file=sys.stderr, flush=True)
            runs[variant].append(_run_once(artifact, runtime_dir, args, modes[variant]))
    threads = next(iter(runs.values()))[0]["torch_threads"]
    report = {"artifact": name, "steps": args.steps, "repeats": args.repeats, "temperature": args.temperature,
              "torch_threads": threads, "baseline": args.baseline, "async_scheduling": modes,
              "results": {v: _aggregate(r) for v, r in runs.items()}, "runs": runs}
    for variant, agg in report["results"].items():
        print(_table(f"\n[{variant}] {name}, steady decode, {args.steps} steps x {args.repeats} runs "
                     f"(median of runs), temperature {args.temperature:g}, {threads} torch threads", agg))
    if args.baseline or args.async_scheduling == "both":
        a, b = list(report["results"])
        base, cur = report["results"][a], report["results"][b]
        print(f"\nstep mean, {a} -> {b}: " + ", ".join(
            f"B={s}: {base[s]['step_us']['mean']:.0f} -> {cur[s]['step_us']['mean']:.0f} µs "
            f"({base[s]['step_us']['mean'] / cur[s]['step_us']['mean']:.2f}x)" for s in cur))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
