"""TTFT of a returning session whose prefix was evicted, with and without the CPU offload tier (`--kv-offload`).

Starts `kiln serve ARTIFACT --num-kv-blocks N` on 127.0.0.1 (with `--kv-offload SIZE` for "tier", `--kv-offload 0`
for "none"), then per round: a session's first turn (a prompt of `--prefix-len` random tokens), `--evictors` other
sessions of the same length (they fill the pool, so the first session's blocks are evicted: to the tier, or gone),
then the first session returns (its prompt + `--turn-len` new tokens) and its time to first token is measured
(streamed /v1/completions, token-id prompts, greedy, one request at a time). Reports the median and p90 returning
TTFT, the first turns' TTFT (nothing cached: the cost of recomputing), and the tier's counters from /metrics.
Modes alternate per run (tier, none) so that a noisy machine hits both alike.

    python benchmarks/kv_offload.py --prefix-len 448 --rounds 8
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import ensure_artifact, kiln_server, metric  # noqa: E402


def _ttft(client: httpx.Client, prompt: list[int]) -> float:
    start = time.perf_counter()
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"] \
                    is not None:
                ttft = time.perf_counter() - start
                for _ in response.iter_lines():  # drain
                    pass
                return ttft
    raise AssertionError("no token streamed")


def run_mode(artifact: Path, offload: str, args: argparse.Namespace) -> dict:
    with kiln_server(artifact, "--num-kv-blocks", str(args.num_kv_blocks), "--kv-offload", offload,
                     "--served-model-name", "m") as url:
        rng = random.Random(args.seed)
        first, back = [], []

        def prompt(n: int) -> list[int]:
            return [rng.randrange(5, args.vocab_size) for _ in range(n)]

        with httpx.Client(base_url=url, timeout=120) as client:
            _ttft(client, prompt(16))  # warm-up
            for _ in range(args.rounds):
                session = prompt(args.prefix_len)
                first.append(_ttft(client, session))
                for _ in range(args.evictors):
                    _ttft(client, prompt(args.prefix_len))
                back.append(_ttft(client, session + prompt(args.turn_len)))
            metrics = client.get("/metrics").text
        return {"offload": offload, "returning_ttft_ms": _summary(back), "first_turn_ttft_ms": _summary(first),
                "tier_hit_tokens": metric(metrics, "kiln:kv_offload_hits_total"),
                "offloaded_blocks": metric(metrics, "kiln:kv_offload_blocks_total"),
                "restored_blocks": metric(metrics, "kiln:kv_restore_blocks_total"),
                "prefix_cache_hit_tokens": metric(metrics, "kiln:prefix_cache_hits_total")}


def _summary(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    return {"median": round(statistics.median(ms), 2), "p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
            "n": len(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="auto", choices=["auto", "embedded", "tiny"])
    p.add_argument("--prefix-len", type=int, default=448, help="tokens of each session's first turn")
    p.add_argument("--turn-len", type=int, default=16, help="new tokens of the returning turn")
    p.add_argument("--evictors", type=int, default=2, help="other sessions between a first turn and its return")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=64, help="the device pool (small, so sessions evict)")
    p.add_argument("--offload", default="64MiB", help="the tier's size in the 'tier' mode")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    name, artifact = ensure_artifact(args.model)
    results = {"model": name, "args": {k: str(v) for k, v in vars(args).items()},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for offload in (args.offload, "0"):
        results["runs"].append(run_mode(artifact, offload, args))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
