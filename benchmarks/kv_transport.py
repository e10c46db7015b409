"""KV transfer over NIXL vs TCP (runtime/disagg's transports): bytes/s and latency of one transfer of N blocks.

A transfer here is what the prefill core sends for N leased blocks: N block frames (runtime/disagg/transport.py's
BlockFrame, the payload one block of the layout, every layer, with its digest) and a Done frame, from a sending
process to a receiving one (two processes on this machine: NIXL's UCX or pyzmq's TCP over loopback); the latency
is from the first send to the receiver holding every frame, as the receiver reports it back over a pipe (one
pipe round trip, ~0.1 ms here, is included). No engine runs: this measures the data plane alone.

    python benchmarks/kv_transport.py [--blocks 1 4 16 64 256] [--repeats 5]

Layouts: `tiny` (the stand-in test artifact: 2 layers, 2 KV heads x 16, block 4, fp32: 2 KiB a block) and
`100m` (a ~100M Llama, the 108 M artifact of docs/performance.md: 12 layers, 12 KV heads x 64, block 16, fp32:
1.1 MiB a block).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

LAYOUTS = {  # name: (layers, block shape (block_size first: K and V of block_size tokens), dtype)
    "tiny": (2, [2, 4, 2, 16], "float32"),
    "100m": (12, [2, 16, 12, 64], "float32"),
}


def _layout(name: str):
    from kiln.runtime.disagg.transport import KVLayout

    layers, shape, dtype = LAYOUTS[name]
    return KVLayout(layers, shape, dtype, shape[1])


def _receiver(kind: str, block_bytes: int, max_blocks: int, conn) -> None:
    from kiln.runtime.disagg.plugins import make_receiver
    from kiln.runtime.disagg.transport import DoneFrame, decode

    rx = make_receiver(kind, block_bytes, max_blocks=max_blocks)
    conn.send(rx.endpoint)
    try:
        while True:
            if conn.poll(0):
                msg = conn.recv()
                if msg == "stop":
                    return
            for data in rx.recv(0.001):
                if isinstance(decode(data), DoneFrame):
                    conn.send(("done", time.perf_counter()))
    finally:
        rx.close()


def _frames(layout, n: int, transfer_id: str) -> list[bytes]:
    from kiln.runtime.disagg.transport import BlockFrame, DoneFrame, block_digest, encode

    payload = os.urandom(layout.block_bytes)
    digests = [block_digest(transfer_id, i, 1, payload) for i in range(n)]
    return [encode(BlockFrame(transfer_id, i, i, 1, d, payload)) for i, d in enumerate(digests)] + [
        encode(DoneFrame(transfer_id, digests))]


def bench(kind: str, layout_name: str, blocks: list[int], repeats: int) -> list[dict]:
    from kiln.runtime.disagg.plugins import connect

    layout = _layout(layout_name)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, layout.block_bytes, max(blocks), child), daemon=True)
    proc.start()
    rows = []
    try:
        if not parent.poll(60):
            raise RuntimeError("the receiver did not start")
        tx = connect(parent.recv())
        warm = _frames(layout, 2, "warm")
        for f in warm:
            tx.send(f)
        assert parent.poll(30) and parent.recv()[0] == "done"
        for n in blocks:
            times = []
            for r in range(repeats):
                frames = _frames(layout, n, f"t{n}-{r}")  # encoded before the clock starts
                start = time.perf_counter()
                for f in frames:
                    tx.send(f)
                if not parent.poll(120):
                    raise RuntimeError(f"{kind}: a {n}-block transfer did not arrive")
                _, arrived = parent.recv()
                times.append(arrived - start)  # perf_counter is system-wide (CLOCK_MONOTONIC) on Linux
            best, med = min(times), statistics.median(times)
            nbytes = n * layout.block_bytes
            rows.append({"transport": kind, "layout": layout_name, "blocks": n, "bytes": nbytes,
                         "median_ms": med * 1e3, "best_ms": best * 1e3, "MB_per_s": nbytes / med / 1e6})
        tx.close()
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--transports", nargs="+", default=["tcp", "nixl"], choices=["tcp", "nixl"])
    args = p.parse_args(argv)
    print("| layout | block bytes | blocks | transport | median ms | best ms | MB/s (median) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.layouts:
        results = {kind: bench(kind, name, args.blocks, args.repeats) for kind in args.transports}
        for i, n in enumerate(args.blocks):
            for kind in args.transports:
                r = results[kind][i]
                print(f"| {name} | {_layout(name).block_bytes} | {n} | {kind} | {r['median_ms']:.2f} | "
                      f"{r['best_ms']:.2f} | {r['MB_per_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
