"""TTFT of a returning session whose prefix was evicted, with and without the CPU offload tier (`--kv-offload`).

Starts `kiln serve ARTIFACT --num-kv-blocks N` on 127.0.0.1 (with `--kv-offload SIZE` for "tier", `--kv-offload 0`
for "none"), then per round: a session's first turn (a prompt of `--prefix-len` random tokens), `--evictors` other
sessions of the same length (they fill the pool, so the first session's blocks are evicted: to the tier, or gone),
then the first session returns (its prompt + `--turn-len` new tokens) and its time to first token is measured
(streamed /v1/completions, token-id prompts, greedy, one request at a time). Reports the median and p90 returning
TTFT, the first turns' TTFT (nothing cached: the cost of recomputing), and the tier's counters from /metrics.
Both servers run at once and every round goes to one, then the other, one request at a time, so that a noisy
machine hits both modes alike.

    python benchmarks/kv_offload.py --prefix-len 448 --rounds 8
    python benchmarks/kv_offload.py --digest-cost   # per block: the tier's host copy vs its BLAKE2b digest
"""
from __future__ import annotations

import argparse
import contextlib
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
    """Send -> first streamed chunk of a greedy completion of `prompt` (2 tokens), read to the end."""
    start = time.perf_counter()
    ttft = None
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - start
    assert ttft is not None, "no chunk streamed"
    return ttft


def run(artifact: Path, args: argparse.Namespace) -> list[dict]:
    """Both servers up at once; each round runs on the tier server, then the same prompts on the other (requests
    one at a time, so they never compete, and a noisy machine hits both modes alike)."""
    modes = (args.offload, "0")
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, args.vocab_size) for _ in range(n)]

    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(base_url=stack.enter_context(kiln_server(
            artifact, "--num-kv-blocks", str(args.num_kv_blocks), "--kv-offload", mode, "--served-model-name", "m")),
            timeout=120)) for mode in modes]
        first: list[list[float]] = [[], []]
        back: list[list[float]] = [[], []]
        for client in clients:
            _ttft(client, prompt(16))  # warm-up
        for _ in range(args.rounds):
            session, others, turn = prompt(args.prefix_len), [prompt(args.prefix_len) for _ in range(args.evictors)], \
                prompt(args.turn_len)
            for m, client in enumerate(clients):
                first[m].append(_ttft(client, session))
                for other in others:
                    _ttft(client, other)
                back[m].append(_ttft(client, session + turn))
        results = []
        for m, client in enumerate(clients):
            metrics = client.get("/metrics").text
            results.append({"offload": modes[m], "returning_ttft_ms": _summary(back[m]),
                            "first_turn_ttft_ms": _summary(first[m]),
                            "tier_hit_tokens": metric(metrics, "kiln:kv_offload_hits_total"),
                            "offloaded_blocks": metric(metrics, "kiln:kv_offload_blocks_total"),
                            "restored_blocks": metric(metrics, "kiln:kv_restore_blocks_total"),
                            "prefix_cache_hit_tokens": metric(metrics, "kiln:prefix_cache_hits_total")})
        return results


def _summary(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    return {"median": round(statistics.median(ms), 2), "p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
            "n": len(ms)}


def digest_cost(blocks: int = 64, repeats: int = 5) -> None:
    """Per block, best of `repeats` passes over `blocks`: the offload's device -> host copy (every layer's slice)
    against the tier's digest of it (`HostKV._content_digest`), one torch thread, two KV layouts."""
    import torch
    from kiln.runtime.core.kv_cache import BlockManager
    from kiln.runtime.core.kv_offload import OffloadTier
    from kiln.runtime.core.prefix_cache import PrefixCache

    torch.set_num_threads(1)
    print("| layout | block bytes | copy µs / block | BLAKE2b digest µs / block |\n|---|---|---|---|")
    for name, (layers, heads, dim) in {"embedded": (6, 4, 32), "108M Llama": (12, 12, 64)}.items():
        kv = [torch.randn(blocks, 2, 16, heads, dim) for _ in range(layers)]
        tier = OffloadTier(BlockManager(blocks, 16, PrefixCache()), kv, blocks)
        copy = digest = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for b in range(blocks):
                for host, dev in zip(tier.host, kv, strict=True):
                    host[b].copy_(dev[b])
            copy = min(copy, (time.perf_counter() - t) / blocks)
            t = time.perf_counter()
            for b in range(blocks):
                tier.store._content_digest(b)
            digest = min(digest, (time.perf_counter() - t) / blocks)
        print(f"| {name} ({layers} layers x {heads} KV heads x {dim}, block 16, fp32) | "
              f"{tier.block_bytes // 1024} KiB | {copy * 1e6:.0f} | {digest * 1e6:.0f} |")


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
    p.add_argument("--digest-cost", action="store_true", help="only the per-block copy vs digest microbenchmark")
    args = p.parse_args()
    if args.digest_cost:
        digest_cost()
        return
    name, artifact = ensure_artifact(args.model)
    results = {"model": name, "args": {k: str(v) for k, v in vars(args).items()},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    results["runs"] = run(artifact, args)
    for r in results["runs"]:
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
