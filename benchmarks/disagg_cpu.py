"""Disaggregation and the KV-aware router on the CPU target, served (`kiln serve` in its own process, kiln's
`kiln bench serve` client).

    python benchmarks/disagg_cpu.py --mode disagg   # one core vs 1 prefill + 1 decode core (always, auto)
    python benchmarks/disagg_cpu.py --mode router   # 2 replicas: KV-aware vs round robin, multi-turn chats
    python benchmarks/disagg_cpu.py --mode long     # disagg with 2K-token prompts, on the same cores

disagg: `--long` prompts of `--long-len` tokens and `--short` chats of 32 tokens (32 output tokens each) arrive as
a Poisson stream at `--rate` per second; reports TTFT of the short and the long requests and the inter-token
latency (p50, p99) of all, per configuration; the cores share the same CPUs (each core 1 thread: the single core
gets 1, the pair 1 + 1). long: the same with `--long-len` 2048 on a random Llama with a 4K context (`--artifact
long`, benchmarks/_artifacts.py), and on the same cores: the co-located core gets 2 threads, the pair 1 + 1. router: `--sessions` chats of `--turns` turns at once, each turn's prompt the previous
one plus 16 "assistant" and 48 "user" tokens (so a turn shares its whole history with the last), 16 output
tokens, `--think-ms` (mean, exponential) between turns; reports TTFT per turn after the first, the replicas'
prefix-cache hit rate and the time until every chat ended. The artifact:
benchmarks/_artifacts.py (the embedded model when its checkpoint exists, else a tiny random Llama).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import socket
import subprocess
import sys
import time

import httpx
from _artifacts import ensure_artifact

from kiln.bench import RequestSpec, _send, build_report, percentile


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, artifact, *flags: str, threads: int = 1) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--port",
                                      str(self.port), "--num-threads", str(threads), "--log-level", "warning",
                                      *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, "kiln serve exited"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kiln serve did not come up"
            time.sleep(0.2)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 200) for _ in range(n)]


async def _disagg_run(server: Server, specs: list[tuple[str, RequestSpec]], rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        url = server.url + "/v1/completions"
        t0 = time.perf_counter()
        offsets, t = [], 0.0
        for _ in specs:
            offsets.append(t)
            t += rng.expovariate(rate)

        async def one(spec: RequestSpec, at: float):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await _send(client, url, server.model, spec)
        results = await asyncio.gather(*(one(s, at) for (_, s), at in zip(specs, offsets)))
        duration = time.perf_counter() - t0
    out = {}
    for kind in ("short", "long"):
        sub = [r for (k, _), r in zip(specs, results) if k == kind]
        out[kind] = build_report(sub, duration, {}, {})
    out["all"] = build_report(list(results), duration, {}, {})
    return out


def run_disagg(args, artifact) -> None:
    rng = random.Random(0)
    specs = [("long", RequestSpec(_ids(rng, args.long_len), 32)) for _ in range(args.long)] + \
            [("short", RequestSpec(_ids(rng, 32), 32)) for _ in range(args.short)]
    rng.shuffle(specs)
    same_cores = args.mode == "long"  # the co-located core gets the pair's two threads
    configs = {"one core" + (" (2 threads)" if same_cores else ""): ((), 2 if same_cores else 1),
               "1P+1D always": (("--disaggregate", "--remote-prefill", "always"), 1),
               "1P+1D auto": (("--disaggregate", "--remote-prefill", "auto"), 1)}
    print(f"{len(specs)} requests ({args.long} x {args.long_len} tokens, {args.short} x 32), 32 output tokens, "
          f"Poisson {args.rate}/s")
    print("| configuration | TTFT short p50 / p99 ms | TTFT long p50 / p99 ms | ITL p50 / p99 ms | failed |")
    print("|---|---|---|---|---|")
    for name, (flags, threads) in configs.items():
        server = Server(artifact, "--num-kv-blocks", str(args.kv_blocks), *flags, threads=threads)
        try:
            asyncio.run(_disagg_run(server, specs[:4], args.rate, 1))  # warm-up
            rep = asyncio.run(_disagg_run(server, specs, args.rate, 2))
        finally:
            server.close()
        s, lo, a = rep["short"], rep["long"], rep["all"]
        print(f"| {name} | {s['ttft_ms']['p50']:.1f} / {s['ttft_ms']['p99']:.1f} | {lo['ttft_ms']['p50']:.1f} / "
              f"{lo['ttft_ms']['p99']:.1f} | {a['itl_ms']['p50']:.1f} / {a['itl_ms']['p99']:.1f} | {a['failed']} |")


async def _sessions(server: Server, sessions: int, turns: int, think_s: float) -> tuple[list[list[float]], float]:
    """Each chat's TTFTs, and the seconds until the last chat ended."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        url = server.url + "/v1/completions"

        async def chat(i: int) -> list[float]:
            rng = random.Random(100 + i)
            prompt, ttfts = _ids(rng, 64), []
            for k in range(turns):
                if k and think_s:  # the user reads and types (exponential, mean think_s)
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                r = await _send(client, url, server.model, RequestSpec(list(prompt), 16))
                ttfts.append(r.ttft if r.ok else float("nan"))
                prompt += _ids(rng, 16) + _ids(rng, 48)
            return ttfts
        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(chat(i) for i in range(sessions)))
        return ttfts, time.perf_counter() - t0


def run_router(args, artifact) -> None:
    print(f"{args.sessions} chats x {args.turns} turns at once, think time {args.think_ms:g} ms, 2 replicas (1 thread "
          "each)")
    print("| policy | prefix-cache hit rate | TTFT turns 2.. p50 / p99 ms | requests per replica | all chats done s |")
    print("|---|---|---|---|---|")
    for policy in ("kv", "round_robin"):
        server = Server(artifact, "--replicas", "2", "--router-policy", policy, "--num-kv-blocks",
                        str(args.kv_blocks))
        try:
            ttfts, wall = asyncio.run(_sessions(server, args.sessions, args.turns, args.think_ms / 1e3))
            hits, queries = server.metric("kiln:prefix_cache_hits_total"), server.metric("kiln:prefix_cache_queries_total")
            routed = [server.metric(f'kiln:router_requests_total{{replica="{i}"}}') for i in range(2)]
        finally:
            server.close()
        later = [t * 1e3 for s in ttfts for t in s[1:]]
        print(f"| {policy} | {hits / max(queries, 1):.2f} | {percentile(later, 50):.1f} / "
              f"{percentile(later, 99):.1f} | {routed[0]:.0f} / {routed[1]:.0f} | {wall:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["disagg", "router", "long"], required=True)
    ap.add_argument("--artifact", help="auto | embedded | tiny | long (default: long for --mode long, else auto)")
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-len", type=int, help="default 2048 for --mode long, else 384")
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think-ms", type=float, default=0.0, help="router: mean pause between a chat's turns")
    ap.add_argument("--kv-blocks", type=int, default=2048)
    args = ap.parse_args()
    long = args.mode == "long"
    args.long_len = args.long_len or (2048 if long else 384)
    name, artifact = ensure_artifact(args.artifact or ("long" if long else "auto"))
    print(f"artifact: {name} ({artifact}); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    (run_router if args.mode == "router" else run_disagg)(args, artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
