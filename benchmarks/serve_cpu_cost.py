"""CPU seconds per output token, offline `LLM.generate` against `kiln serve` (API server + engine core +
client), everything pinned to one core with one intra-op thread (`--client-core C`: the client on another): a
figure that a busy machine disturbs far less than tokens per second do (the run's wall-clock throughput is printed
too).

    python benchmarks/serve_cpu_cost.py ARTIFACT --batch 64 --prompts 96 --mode offline
    python benchmarks/serve_cpu_cost.py ARTIFACT --batch 64 --prompts 96 --mode served

Workload: `--prompts` prompts of 128 random token ids in [8, 4000), 64 output tokens each, greedy, ignore_eos;
offline with max_num_seqs = `--batch`, served with kiln's `kiln bench serve` client at concurrency `--batch`.
Served CPU time is read from /proc for the server and its engine core, and from getrusage for the client.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import resource
import socket
import subprocess
import sys
import time

OUTPUT_LEN = 64


def _proc_cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--mode", choices=["offline", "served"], required=True)
    ap.add_argument("--core", type=int, default=0, help="the CPU everything runs on (default 0)")
    ap.add_argument("--client-core", type=int, help="served: run the client on this CPU instead (the server, API "
                    "server and engine core, stays on --core)")
    ap.add_argument("--serve-args", default="", help="more `kiln serve` options, e.g. '--stream-interval 4'")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 4000) for _ in range(128)] for _ in range(args.prompts)]
    if args.mode == "offline":
        import kiln

        llm = kiln.LLM(args.artifact, max_num_seqs=args.batch)
        llm.generate(prompts[:4], kiln.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        c0, t0 = _self_cpu(), time.monotonic()
        outs = llm.generate(prompts, kiln.SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True))
        c1, t1 = _self_cpu(), time.monotonic()
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"offline batch {args.batch}: {n} tokens, {(c1 - c0) / n * 1000:.3f} ms CPU/token, "
              f"{n / (t1 - t0):.0f} tok/s wall")
        return 0
    from kiln.bench import RequestSpec, run_serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", args.artifact, "--port", str(port),
                             "--num-threads", "1", "--log-level", "warning", "--num-kv-blocks", "4096",
                             *args.serve_args.split()],
                            stdout=subprocess.PIPE, text=True)
    if args.client_core is not None:  # the server inherited --core; the client moves off it
        os.sched_setaffinity(0, {args.client_core})
    try:
        core = int(re.search(r"engine core pid (\d+)", proc.stdout.readline()).group(1))
        url = f"http://127.0.0.1:{port}"
        specs = [RequestSpec(prompt=p, output_len=OUTPUT_LEN) for p in prompts]
        asyncio.run(run_serve(url, requests=specs[:4], max_concurrency=4))  # warm-up
        a0, k0, c0, t0 = _proc_cpu(proc.pid), _proc_cpu(core), _self_cpu(), time.monotonic()
        report = asyncio.run(run_serve(url, requests=specs, max_concurrency=args.batch))
        a1, k1, c1, t1 = _proc_cpu(proc.pid), _proc_cpu(core), _self_cpu(), time.monotonic()
        n = report["total_output_tokens"]
        print(f"served concurrency {args.batch}: {n} tokens; ms CPU/token: API server {(a1 - a0) / n * 1000:.3f}, "
              f"engine core {(k1 - k0) / n * 1000:.3f}, client {(c1 - c0) / n * 1000:.3f}; "
              f"{n / (t1 - t0):.0f} tok/s wall; {report['failed']} failed")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
