"""TTFT with the prefix cache on and off: a shared-prefix workload against a live `kiln serve`.

Starts `kiln serve ARTIFACT` on 127.0.0.1 (with `--no-prefix-cache` for "off"), sends the same requests
(each prompt = one of K shared random prefixes of P tokens + a unique suffix) with `kiln.bench.run_serve`,
reads `kiln:prefix_cache_hits_total` / `kiln:prefix_cache_queries_total` from /metrics, stops the server.
Modes alternate (on, off, on, off, ...) so that a noisy machine hits both alike.

    python benchmarks/prefix_cache.py --prefix-len 384 --num-prefixes 4 --num-prompts 64 --max-concurrency 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import ensure_artifact, kiln_server, metric  # noqa: E402

from kiln.bench import make_requests, run_serve  # noqa: E402


def run_mode(artifact: Path, prefix_cache: bool, args: argparse.Namespace) -> dict:
    with kiln_server(artifact, *([] if prefix_cache else ["--no-prefix-cache"])) as url:
        vocab = args.vocab_size
        requests = make_requests(args.num_prompts, input_len=args.suffix_len, output_len=args.output_len,
                                 shared_prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                                 vocab_size=vocab, seed=args.seed)
        report = asyncio.run(run_serve(url, requests=requests, max_concurrency=args.max_concurrency,
                                       request_rate=args.request_rate, seed=args.seed))
        metrics = httpx.get(url + "/metrics").text
        report["prefix_cache_hits_tokens"] = metric(metrics, "kiln:prefix_cache_hits_total")
        report["prefix_cache_queries_tokens"] = metric(metrics, "kiln:prefix_cache_queries_total")
        report["prefix_cache"] = prefix_cache
        return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", help="artifact dir (default: embedded model if present, else a tiny Llama)")
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--vocab-size", type=int, help="prompt ids from [8, V) (default: the artifact's vocabulary)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    name, artifact = (args.artifact, Path(args.artifact)) if args.artifact else ensure_artifact()
    if args.vocab_size is None:
        args.vocab_size = json.loads((artifact / "manifest.json").read_text())["runtime"]["vocab_size"]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for mode in ("on", "off"):
            print(f"run {i + 1}/{args.repeats}: prefix cache {mode} ...", file=sys.stderr, flush=True)
            runs[mode].append(run_mode(artifact, mode == "on", args))
    print(f"\n{name}: {args.num_prompts} requests, {args.num_prefixes} shared prefixes of {args.prefix_len} tokens + "
          f"{args.suffix_len} unique, {args.output_len} output tokens, concurrency {args.max_concurrency}; "
          f"{args.repeats} runs per mode (median; range)")
    print(f"{'prefix cache':<14}{'TTFT p50 ms':>22}{'TTFT p90 ms':>22}{'E2E p50 ms':>12}{'req/s':>8}"
          f"{'hit tokens':>12}{'hit rate':>10}")
    summary = {}
    for mode, reports in runs.items():
        def med(key, stat, reports=reports):
            xs = [r[key][stat] for r in reports]
            return statistics.median(xs), min(xs), max(xs)
        p50, p90 = med("ttft_ms", "p50"), med("ttft_ms", "p90")
        hits = statistics.median(r["prefix_cache_hits_tokens"] for r in reports)
        queries = statistics.median(r["prefix_cache_queries_tokens"] for r in reports)
        rps = statistics.median(r["request_throughput"] for r in reports)
        e2e = med("e2e_ms", "p50")[0]
        summary[mode] = {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "e2e_p50_ms": e2e, "request_throughput": rps,
                         "prefix_cache_hits_tokens": hits, "prefix_cache_queries_tokens": queries}
        rate = f"{hits / queries:.0%}" if queries else "-"
        print(f"{mode:<14}{p50[0]:>8.1f} ({p50[1]:.0f}..{p50[2]:.0f}){p90[0]:>10.1f} ({p90[1]:.0f}..{p90[2]:.0f})"
              f"{e2e:>12.1f}{rps:>8.2f}{hits:>12.0f}{rate:>10}")
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": name, "args": vars(args), "summary": summary,
                                               "runs": runs}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
