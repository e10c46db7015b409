"""The prefix cache's block keys (issue 29 item 2): SHA-256 over packed token ids (runtime/block_hash.py) against
the Python `hash` of a tuple they replaced, for one prompt's full blocks, best of R runs of N calls.

    python benchmarks/block_hash_cost.py [--tokens 8192] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import timeit

from kiln.runtime.block_hash import block_hashes


def python_hash_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The keys before issue 29: hash((parent, tuple(block))) per full block."""
    out, parent = [], 0x6B696C6E
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return out


def sha256_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """The keys now, from scratch (no keys known yet: each call hashes every block)."""
    return block_hashes(token_ids, block_size, [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--number", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args()
    ids = [(i * 7919) % 151_000 for i in range(args.tokens)]

    def best(fn, *fn_args) -> float:  # µs per call
        return round(min(timeit.repeat(lambda: fn(*fn_args), repeat=args.repeats, number=args.number))
                     / args.number * 1e6, 1)

    rows = [{"block_size": bs, "python_hash_us": best(python_hash_chain, ids, bs),
             "sha256_us": best(sha256_chain, ids, bs)} for bs in (16, 64)]
    result = {"tokens": args.tokens, "machine": platform.processor() or platform.machine(), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
