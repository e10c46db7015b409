"""The multi-LoRA kernels of GPU targets on one GPU: the Triton segmented shrink/expand (`lora` of the rendered
triton library) against the torch kernel GPU targets ran before it (the cpu library's `lora` on CUDA tensors: a
shrink and an expand GEMM per adapter, gathered and scattered with index_select / index_add).

    python benchmarks/gpu_lora.py [--out DIR] [--rank 16] [--dtype bf16]
    python benchmarks/gpu_lora.py --cpu-smoke     # the same code under Triton's interpreter, tiny shapes

Shapes are Llama-3-8B's fused q/k/v linear (K 4096, output rows 4096 + 1024 + 1024) with 8 adapter slots of rank
`--rank`. Cases: decode batches of 1, 16 and 64 sequences spread over 1, 4 and 8 adapters (every sequence
adapted), and a prefill of 2 x 1024 tokens of two adapters. For each: microseconds per call of both kernels
(triton.testing.do_bench, median) and the Triton kernel's bytes limit — each adapter's A and B read once, x
read, y read and written — as GB/s achieved. Writes DIR/gpu_lora.json and prints a table. Without CUDA (and no
--cpu-smoke) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA = dict(k=4096, rows=(4096, 1024, 1024), slots=8)
SMOKE = dict(k=64, rows=(32, 16, 16), slots=4)
CASES = [("decode", 1, 1), ("decode", 16, 4), ("decode", 64, 8), ("prefill", 2048, 2)]
SMOKE_CASES = [("decode", 4, 2), ("prefill", 40, 2)]


def _kernels(smoke: bool, dtype: str):
    sys.path.insert(0, str(REPO / "tests" / "codegen"))
    from codegen_helpers import render_kernels

    return render_kernels(Path(tempfile.mkdtemp(prefix="kiln_lora_bench_")), head_dim=128, num_heads=32,
                          num_kv_heads=8, dtype=dtype, block_size=16, lora=True)


def _case(K, shape: dict, kind: str, tokens: int, adapters: int, rank: int, dtype, device, timer) -> dict:
    import torch
    from lora_kernel_lib import TARGET, lora_batch, lora_weights

    g = torch.Generator().manual_seed(0)
    rows, k = shape["rows"], shape["k"]
    a, b = lora_weights(1, shape["slots"], rows, rank, k, [[rank] * len(rows)] * shape["slots"], dtype, g,
                        device=device)
    slot_of_row = ([t % adapters for t in range(tokens)] if kind == "decode"
                   else [t * adapters // tokens for t in range(tokens)])
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    y = torch.randn(tokens, sum(rows), generator=g).to(device, dtype)
    batch = lora_batch(a, b, slot_of_row, list(range(adapters)), {s: rank for s in range(shape["slots"])})
    out = {"case": kind, "tokens": tokens, "adapters": adapters, "rank": rank}
    out["triton_us"] = timer(lambda: K.lora(x, y, batch, TARGET, 0, rows=rows))
    out["torch_us"] = timer(lambda: K._ref.lora(x, y, batch, TARGET, 0))
    size = x.element_size()
    per_adapter = (len(rows) * rank * k + sum(rows) * rank) * size
    out["bytes"] = adapters * per_adapter + x.numel() * size + 2 * y.numel() * size
    out["triton_gbps"] = out["bytes"] / out["triton_us"] / 1e3
    out["speedup"] = out["torch_us"] / out["triton_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (render_kernels imports it)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_lora: no CUDA device; nothing measured (--cpu-smoke runs the code path on CPU)")
        return 0
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    K = _kernels(args.cpu_smoke, "bfloat16" if args.dtype == "bf16" else "float32")
    if args.cpu_smoke:
        import time

        def timer(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        device, shape, cases = torch.device("cpu"), SMOKE, SMOKE_CASES
    else:
        import triton

        def timer(fn):
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
        device, shape, cases = torch.device("cuda"), LLAMA, CASES
    rank = min(args.rank, 8) if args.cpu_smoke else args.rank
    results = [_case(K, shape, kind, n, ad, rank, dtype, device, timer) for kind, n, ad in cases]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke)"
    report = {"device": gpu, "dtype": args.dtype, "shape": {**shape, "rows": list(shape["rows"])},
              "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_lora.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{gpu}, {args.dtype}, K={shape['k']}, rows={shape['rows']}, rank={rank}")
    print(f"{'case':8} {'tokens':>6} {'adapters':>8} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'GB/s':>8}")
    for r in results:
        print(f"{r['case']:8} {r['tokens']:6d} {r['adapters']:8d} {r['triton_us']:10.1f} {r['torch_us']:10.1f} "
              f"{r['speedup']:8.2f} {r['triton_gbps']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
