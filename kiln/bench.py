"""`kiln bench`: a serving load generator (`serve`, `sweep`) and the engine's own per-step CPU cost (`engine`).

`serve` drives a running server through the streaming OpenAI completions endpoint with fixed-length outputs
(`ignore_eos`) and reports, per request, TTFT (send -> first streamed text), TPOT ((E2E - TTFT) / (output
tokens - 1)), ITL (gaps between streamed chunks) and E2E; then request and token throughput and goodput
(requests per second that met every SLO given). `sweep` runs `serve` over a ladder of request rates and draws
goodput and throughput against rate. `engine` times the phases of `LLMEngine.step()` in steady decode with an
executor that returns precomputed logits, so everything measured is the engine's own Python.

Only the standard library is imported at module level: `kiln --help` must not pay for httpx, torch or
matplotlib.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_KEYS = ("ttft", "tpot", "e2e")
# Token ids drawn for synthetic prompts when the vocabulary size is not given: above the usual special tokens
# and below 256, so any byte-level vocabulary holds them.
DEFAULT_ID_RANGE = (8, 256)


# Statistics -----------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default): the value at
    fractional rank q/100 * (n - 1) of the sorted list. NaN for an empty list."""
    if not values:
        return math.nan
    assert 0 <= q <= 100, f"percentile {q} outside [0, 100]"
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 (and the count) of `values` times `scale` (e.g. 1e3 for seconds -> ms)."""
    xs = [v * scale for v in values]
    mean = sum(xs) / len(xs) if xs else math.nan
    return {"mean": mean, "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "count": len(xs)}


# Workload -------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt)


def make_requests(num_prompts: int, *, input_len: int = 128, output_len: int = 128, dataset: str = "random",
                  shared_prefix_len: int = 0, num_prefixes: int = 1, vocab_size: int | None = None,
                  max_model_len: int | None = None, seed: int = 0) -> list[RequestSpec]:
    """Synthetic token-id prompts. `random`: every request has exactly `input_len` prompt tokens (after the
    shared prefix) and `output_len` output tokens. `sharegpt-like`: lognormal lengths whose medians are
    `input_len` and `output_len` (sigma 0.9 and 0.8, roughly ShareGPT's spread), so a few requests are long
    and most are short; same seed, same lengths. With `shared_prefix_len`, each request starts with one of
    `num_prefixes` fixed random prefixes (round robin), the workload a prefix cache is for. `max_model_len`
    clips sharegpt-like lengths so that prompt + output fit the model (random lengths are never changed)."""
    assert num_prompts >= 1 and input_len >= 1 and output_len >= 1, "lengths and counts must be positive"
    rng = random.Random(seed)
    lo, hi = (DEFAULT_ID_RANGE if vocab_size is None else (min(8, vocab_size - 1), vocab_size))

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    prefixes = [ids(shared_prefix_len) for _ in range(max(1, num_prefixes))] if shared_prefix_len else [[]]
    specs = []
    for i in range(num_prompts):
        if dataset == "random":
            n_in, n_out = input_len, output_len
        elif dataset == "sharegpt-like":
            n_in = max(1, round(rng.lognormvariate(math.log(input_len), 0.9)))
            n_out = max(1, round(rng.lognormvariate(math.log(output_len), 0.8)))
        else:
            raise ValueError(f"unknown dataset {dataset!r} (known: random, sharegpt-like)")
        prefix = prefixes[i % len(prefixes)]
        if dataset != "random" and max_model_len is not None:  # fit the model: trim the tail, never the prefix
            n_out = min(n_out, max(1, max_model_len // 4))
            n_in = max(1, min(n_in, max_model_len - n_out - len(prefix) - 1))
        specs.append(RequestSpec(prompt=prefix + ids(n_in), output_len=n_out))
    return specs


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from start) of a Poisson process of `request_rate` per second; all 0 when inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    assert request_rate > 0, "request rate must be positive"
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


# The client -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestResult:
    ok: bool
    input_len: int
    output_len: int = 0  # tokens the server generated (from the usage chunk)
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


async def _send(client: Any, url: str, model: str, spec: RequestSpec) -> RequestResult:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, input_len=spec.input_len)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                # The server streams a chunk when text is ready or a completion ends (a token whose bytes
                # do not yet form a character rides with the next one): each chunk is one delivery.
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = last is not None
        if not result.ok:
            result.error = "the stream carried no choices"
    except Exception as e:  # a benchmark reports failures, it does not stop at the first
        result.error = f"{type(e).__name__}: {e}"
    return result


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:30'] -> {'ttft': 500.0, 'tpot': 30.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        slos[key] = float(value)
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft * 1e3, "tpot": r.tpot * 1e3, "e2e": r.e2e * 1e3}
    return r.ok and all(got[k] <= v for k, v in slos.items())


def build_report(results: list[RequestResult], duration: float, slos: dict[str, float],
                 config: dict[str, Any]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in done)
    good = sum(1 for r in done if meets_slos(r, slos))
    report: dict[str, Any] = {
        "config": config, "num_prompts": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": duration,
        "total_input_tokens": sum(r.input_len for r in done), "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.input_len for r in done)) / duration,
        "goodput_slos_ms": slos, "good_requests": good, "goodput": good / duration,
    }
    report["ttft_ms"] = summarize([r.ttft for r in done], 1e3)
    report["tpot_ms"] = summarize([r.tpot for r in done if r.output_len > 1], 1e3)
    report["itl_ms"] = summarize([x for r in done for x in r.itl], 1e3)
    report["e2e_ms"] = summarize([r.e2e for r in done], 1e3)
    return report


async def run_serve(base_url: str, *, model: str | None = None, requests: list[RequestSpec],
                    request_rate: float = math.inf, max_concurrency: int | None = None,
                    goodput: dict[str, float] | None = None, seed: int = 0, timeout: float = 600.0,
                    config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sends `requests` (Poisson arrivals at `request_rate`, at most `max_concurrency` in flight) and
    returns the report (see `build_report`)."""
    import httpx

    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            r = await client.get(base_url + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = base_url + "/v1/completions"
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(spec: RequestSpec, at: float, t0: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if gate is None:
                return await _send(client, url, model, spec)
            async with gate:
                return await _send(client, url, model, spec)

        offsets = arrival_offsets(len(requests), request_rate, seed)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(s, at, t0) for s, at in zip(requests, offsets)))
        duration = time.perf_counter() - t0
    config = {"base_url": base_url, "model": model, "request_rate": request_rate,
              "max_concurrency": max_concurrency, "seed": seed, **(config or {})}
    return build_report(list(results), duration, goodput or {}, config)


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    slos = ", ".join(f"{k}<={v:g}ms" for k, v in report["goodput_slos_ms"].items()) or "none"
    lines = [
        f"{'requests (completed/sent)':<30}{report['completed']}/{report['num_prompts']}"
        + (f"   errors: {report['errors']}" if report["errors"] else ""),
        f"{'request rate / concurrency':<30}{c['request_rate']} req/s / {c['max_concurrency'] or 'unbounded'}",
        f"{'duration':<30}{report['duration_s']:.2f} s",
        f"{'input / output tokens':<30}{report['total_input_tokens']} / {report['total_output_tokens']}",
        f"{'request throughput':<30}{report['request_throughput']:.2f} req/s",
        f"{'output token throughput':<30}{report['output_token_throughput']:.1f} tok/s",
        f"{'goodput (' + slos + ')':<30}{report['goodput']:.2f} req/s ({report['good_requests']} good)",
        "",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for m in METRICS:
        s = report[f"{m}_ms"]
        lines.append(f"{m.upper():<6}" + "".join(f"{s[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


# Sweep ----------------------------------------------------------------------------------------------------
def run_sweep(base_url: str, rates: list[float], make: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """One `run_serve` per rate, each with a fresh workload from `make()` (same seed: same prompts)."""
    return [asyncio.run(run_serve(base_url, requests=make(), request_rate=rate, **kwargs)) for rate in rates]


def plot_sweep(reports: list[dict[str, Any]], png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["config"]["request_rate"] for r in reports]
    fig, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(10, 4))
    ax_req.plot(rates, [r["request_throughput"] for r in reports], "o-", label="throughput")
    slos = reports[0]["goodput_slos_ms"]
    label = "goodput (" + ", ".join(f"{k}<={v:g}ms" for k, v in slos.items()) + ")" if slos else "goodput"
    ax_req.plot(rates, [r["goodput"] for r in reports], "s--", label=label)
    ax_req.plot(rates, rates, ":", color="grey", label="offered rate")
    ax_req.set(xlabel="offered request rate (req/s)", ylabel="req/s", title="requests")
    ax_req.legend()
    ax_tok.plot(rates, [r["output_token_throughput"] for r in reports], "o-")
    ax_tok.set(xlabel="offered request rate (req/s)", ylabel="output tok/s", title="output tokens")
    for ax in (ax_req, ax_tok):
        ax.grid(alpha=0.3)
    fig.suptitle(f"kiln bench sweep — {reports[0]['config']['model']}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def format_sweep(reports: list[dict[str, Any]]) -> str:
    lines = [f"{'rate':>8}{'req/s':>9}{'goodput':>9}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p90':>10}"
             f"{'TPOT p50':>10}{'TPOT p90':>10}{'fail':>6}"]
    for r in reports:
        lines.append(f"{r['config']['request_rate']:>8g}{r['request_throughput']:>9.2f}{r['goodput']:>9.2f}"
                     f"{r['output_token_throughput']:>9.1f}{r['ttft_ms']['p50']:>10.1f}{r['ttft_ms']['p90']:>10.1f}"
                     f"{r['tpot_ms']['p50']:>10.1f}{r['tpot_ms']['p90']:>10.1f}{r['failed']:>6}")
    return "\n".join(lines)


# Engine overhead ------------------------------------------------------------------------------------------
PHASES = ("schedule", "prepare", "execute", "sample", "update", "process")


class InstantModel:
    """Stand-in executor: `forward` returns rows of precomputed logits, so a step's time is the engine's."""

    def __init__(self, vocab_size: int, max_rows: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_rows, vocab_size, generator=g)

    def forward(self, batch: Any, kv_caches: Any) -> Any:
        return self.logits[:batch.logits_indices.shape[0]]


def _timed_step(engine: Any, clock: Any) -> dict[str, float]:
    """`LLMEngine.step()` phase by phase (same calls, same order), returning seconds per phase."""
    import torch

    t0 = clock()
    batch = engine.scheduler.schedule()
    t1 = clock()
    fb, layout = engine.runner.prepare(batch)
    t2 = clock()
    with torch.inference_mode():
        logits = engine.runner.model.forward(fb, engine.runner.kv_caches).float()
    t3 = clock()
    sampled = engine.sampler.sample(logits, layout, batch.seqs)
    t4 = clock()
    grown = engine.scheduler.update(batch, sampled.sampled)
    t5 = clock()
    engine.update(batch, sampled, grown)
    t6 = clock()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)))


def run_engine_overhead(artifact: str | Path, *, batch_sizes: tuple[int, ...] = (1, 64, 256), steps: int = 200,
                        prompt_len: int = 32, temperature: float = 0.0, torch_threads: int | None = None,
                        seed: int = 0) -> dict[str, Any]:
    """Steady-decode step cost at each batch size. Per size: admit `n` requests, run until every one is
    decoding, then (a) `steps` instrumented steps for the phase breakdown and (b) `steps` plain
    `engine.step()` calls for steps/s. Outputs never end early (`ignore_eos`, long `max_tokens`).
    `torch_threads` sets torch's intra-op threads for the run (on a busy machine, OpenMP workers fighting
    over cores make every small tensor op cost milliseconds; 1 thread measures the engine's own code)."""
    import torch

    from kiln.runtime.core.batch import cdiv
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    clock = time.perf_counter
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    results: dict[str, Any] = {"artifact": str(artifact), "steps": steps, "prompt_len": prompt_len,
                               "temperature": temperature, "torch_threads": torch.get_num_threads(),
                               "batch_sizes": {}}
    for n in batch_sizes:
        probe = LLMEngine(artifact, num_kv_blocks=1)
        max_len, vocab, bs = probe.model_config.max_model_len, probe.model_config.vocab_size, \
            probe.block_manager.block_size
        del probe
        needed = prompt_len + 2 * steps + 16
        assert needed <= max_len, f"{needed} tokens per sequence exceed max_model_len {max_len}: lower --steps"
        engine = LLMEngine(artifact, num_kv_blocks=n * cdiv(needed, bs) + 8, max_num_seqs=max(n, 1),
                           max_num_batched_tokens=max(8192, n * prompt_len), seed=seed)
        engine.runner.model = InstantModel(vocab, max_rows=n + 1, seed=seed)
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=needed - prompt_len, ignore_eos=True, temperature=temperature)
        for i in range(n):
            engine.add_request(f"r{i}", [rng.randrange(min(8, vocab - 1), vocab) for _ in range(prompt_len)],
                               params)
        while not all(s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        assert len(engine.scheduler.running) == n, "not every sequence is decoding"
        for _ in range(5):  # warm-up: allocator, caches
            engine.step()
        phases: dict[str, list[float]] = {p: [] for p in PHASES}
        totals = []
        for _ in range(steps):
            t = _timed_step(engine, clock)
            for p in PHASES:
                phases[p].append(t[p])
            totals.append(sum(t.values()))
        plain = []
        for _ in range(steps):
            t0 = clock()
            engine.step()
            plain.append(clock() - t0)
        assert len(engine.scheduler.running) == n, "a sequence finished during the measurement"
        results["batch_sizes"][str(n)] = {
            "phases_us": {p: summarize(v, 1e6) for p, v in phases.items()},
            "instrumented_step_us": summarize(totals, 1e6),
            "step_us": summarize(plain, 1e6),
            "steps_per_s": len(plain) / sum(plain),
            "tokens_per_s": n * len(plain) / sum(plain),
        }
    return results


def format_engine(results: dict[str, Any]) -> str:
    lines = [f"engine step CPU cost, steady decode, instant executor ({results['steps']} steps per size, "
             f"temperature {results['temperature']:g}, {results['torch_threads']} torch threads; µs mean / p50 / p90)"]
    head = f"{'phase':<12}" + "".join(f"{'B=' + b:>24}" for b in results["batch_sizes"])
    lines.append(head)
    rows = [(p, lambda r, p=p: r["phases_us"][p]) for p in PHASES]
    rows += [("step", lambda r: r["step_us"])]
    for name, get in rows:
        cells = []
        for r in results["batch_sizes"].values():
            s = get(r)
            cells.append(f"{s['mean']:>8.0f}{s['p50']:>8.0f}{s['p90']:>8.0f}")
        lines.append(f"{name:<12}" + "".join(cells))
    lines.append(f"{'steps/s':<12}" + "".join(f"{r['steps_per_s']:>24.0f}" for r in results["batch_sizes"].values()))
    lines.append(f"{'tokens/s':<12}" + "".join(f"{r['tokens_per_s']:>24.0f}"
                                               for r in results["batch_sizes"].values()))
    return "\n".join(lines)


# CLI ------------------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--dataset", choices=["random", "sharegpt-like"], default="random",
                   help="random: fixed lengths; sharegpt-like: lognormal lengths with medians --input-len/--output-len "
                   "(default random)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="completion tokens per request (default 128)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of a prompt prefix shared between requests, of --input-len (default 0: none)")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="distinct shared prefixes, assigned round robin (default 1)")
    p.add_argument("--vocab-size", type=int, help="draw prompt token ids from [8, V) (default: [8, 256))")
    p.add_argument("--max-model-len", type=int, help="clip sharegpt-like lengths to fit (default: the server's, "
                   "from /v1/models)")
    p.add_argument("--max-concurrency", type=int,
                   help="at most this many requests in flight (default: no limit, arrivals as --request-rate)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs a request must meet to count as goodput, e.g. ttft:500 tpot:30 (e2e also; "
                   "default: none, goodput not reported)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")


def add_bench_parser(sub: Any) -> None:
    """Adds `kiln bench {serve,sweep,engine}` to the `kiln` command's subparsers."""
    p = sub.add_parser("bench", help="benchmark a server (serve, sweep) or the engine's step overhead (engine)")
    bsub = p.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="load a running server with streamed completions; report latencies")
    _add_load_args(s)
    s.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    s.add_argument("--json", help="also write the report as JSON to this file (default: printed only)")
    s.set_defaults(func=cmd_bench_serve)

    w = bsub.add_parser("sweep", help="bench serve over a ladder of request rates; plot goodput and throughput")
    _add_load_args(w)
    w.add_argument("--rates", required=True, help="comma-separated request rates, e.g. 1,2,4,8 (inf allowed)")
    w.add_argument("--png", required=True, help="the plot to write")
    w.add_argument("--json", help="also write every report as JSON to this file (default: printed only)")
    w.set_defaults(func=cmd_bench_sweep)

    e = bsub.add_parser("engine", help="engine CPU time per step in steady decode (instant executor)")
    e.add_argument("artifact", help="a compiled artifact directory (its model is replaced by an instant one)")
    e.add_argument("--batch-sizes", default="1,64,256",
                   help="comma-separated decode batch sizes to measure (default 1,64,256)")
    e.add_argument("--steps", type=int, default=200, help="timed steps per batch size (default 200)")
    e.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default 32)")
    e.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 = greedy (default 0)")
    e.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's)")
    e.add_argument("--json", help="also write the results as JSON to this file (default: printed only)")
    e.set_defaults(func=cmd_bench_engine)


def _workload(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    config = {k: getattr(args, k) for k in ("num_prompts", "dataset", "input_len", "output_len",
                                              "shared_prefix_len", "num_prefixes", "vocab_size")}

    max_model_len = args.max_model_len
    if max_model_len is None and args.dataset != "random":
        max_model_len = _server_max_model_len(args.base_url)
    config["max_model_len"] = max_model_len

    def make() -> list[RequestSpec]:
        return make_requests(args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                             dataset=args.dataset, shared_prefix_len=args.shared_prefix_len,
                             num_prefixes=args.num_prefixes, vocab_size=args.vocab_size,
                             max_model_len=max_model_len, seed=args.seed)
    return make, config


def _server_max_model_len(base_url: str) -> int | None:
    import httpx

    try:
        card = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None
    return card.get("max_model_len")


def _write_json(path: str | None, payload: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    make, config = _workload(args)
    report = asyncio.run(run_serve(args.base_url, model=args.model, requests=make(), request_rate=args.request_rate,
                                   max_concurrency=args.max_concurrency, goodput=parse_goodput(args.goodput),
                                   seed=args.seed, timeout=args.timeout, config=config))
    print(format_report(report))
    print(json.dumps(report, default=str))
    _write_json(args.json, report)
    return 0 if report["completed"] else 1


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    make, config = _workload(args)
    reports = run_sweep(args.base_url, _floats(args.rates), make, model=args.model,
                        max_concurrency=args.max_concurrency, goodput=parse_goodput(args.goodput), seed=args.seed,
                        timeout=args.timeout, config=config)
    plot_sweep(reports, args.png)
    print(format_sweep(reports))
    print(f"wrote {args.png}", file=sys.stderr)
    _write_json(args.json, reports)
    return 0 if all(r["completed"] for r in reports) else 1


def cmd_bench_engine(args: argparse.Namespace) -> int:
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    results = run_engine_overhead(args.artifact, batch_sizes=sizes, steps=args.steps, prompt_len=args.prompt_len,
                                  temperature=args.temperature, torch_threads=args.torch_threads)
    print(format_engine(results))
    _write_json(args.json, results)
    return 0


__all__ = ["RequestResult", "RequestSpec", "build_report", "format_report", "make_requests",
           "percentile", "plot_sweep", "run_engine_overhead", "run_serve", "run_sweep", "summarize"]
