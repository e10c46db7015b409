"""The TVM paged attention of this checkout against another kiln checkout's, timed interleaved in one process.

    python benchmarks/attention_ab.py BASELINE_CHECKOUT [--shapes llama-3.2-1B,...] [--dtypes float32,bfloat16]
        [--kv-mb 256] [--repeats 30] [--threads 1]

For a before/after on a shared machine: each kernel package (kernels/tvm.py and its cpu.so) is built by its own
checkout's compiler (the baseline's in a subprocess that imports kiln from BASELINE_CHECKOUT), then both are
loaded here and called one after the other, with a torch.sum over the same KV bytes (the KV-streaming limit)
between them, for every case of benchmarks/cpu_kernels.py's CASES: load that comes and goes hits all three alike.
Each call takes the next of enough KV cache copies to hold --kv-mb MB, so the KV comes from DRAM, as when a
model's layers each read their own. Prints the median CPU µs per call (process time: with one thread, time
other jobs hold the core does not count) and each kernel's multiple of the limit.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_kernels as ck  # noqa: E402

# kiln's import packages -> their folders in a checkout (pyproject.toml's package-dir)
PACKAGE_DIRS = {"kiln.dsl": "dsl", "kiln.compiler": "compiler", "kiln.passes": "passes", "kiln.codegen": "codegen",
                "kiln.runtime": "runtime", "kiln.models": "models"}
BUILD = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # not this venv's kiln
sys.path.insert(0, {site!r})
from kiln.codegen.tvm_build import write_cpu_kernels
write_cpu_kernels(__import__("pathlib").Path({out!r}), {params!r}, ("tvm.paged_attention",), kiln_version="ab")
"""


def _site(checkout: Path, root: Path) -> Path:
    """A folder from which `import kiln` finds `checkout`'s sources, laid out as the wheel installs them."""
    site = root / "site"
    (site / "kiln").mkdir(parents=True)
    for entry in (checkout / "kiln").iterdir():
        (site / "kiln" / entry.name).symlink_to(entry)
    for package, folder in PACKAGE_DIRS.items():
        (site / "kiln" / package.split(".")[1]).symlink_to(checkout / folder)
    return site


def _packages(root: Path, site: Path, tag: str, heads: int, kv_heads: int, head_dim: int, dtype: str):
    from kiln.codegen.tvm_build import write_cpu_kernels

    params = {"target": "cpu", "head_dim": head_dim, "num_heads": heads, "num_kv_heads": kv_heads,
              "block_size": ck.BLOCK_SIZE, "dtype": dtype}
    base, this = root / f"baseline_{tag}", root / f"this_{tag}"
    subprocess.run([sys.executable, "-c", BUILD.format(site=str(site), out=str(base), params=params)], check=True)
    write_cpu_kernels(this, params, ("tvm.paged_attention",), kiln_version="ab")
    return ck.import_package(base, f"_ab_baseline_{tag}"), ck.import_package(this, f"_ab_this_{tag}")


def run(baseline: Path, shapes: list[str], dtypes: list[str], kv_mb: float, repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        root = Path(tmp)
        site = _site(baseline.resolve(), root)
        for model in shapes:
            _, heads, kv_heads, head_dim, _ = ck.SHAPES[model]
            for dtype in dtypes:
                tag = f"{model}_{dtype}".replace(".", "_").replace("-", "_")
                base, this = _packages(root, site, tag, heads, kv_heads, head_dim, dtype)
                rope = this._ref.rope_cache(head_dim, 4096, 10000.0)
                for kind, n in ck.CASES:
                    q, k, v, kv, batch = ck._batch(kind, n, heads, kv_heads, head_dim, getattr(torch, dtype))
                    copies = max(3, math.ceil(kv_mb * 1e6 / (kv.numel() * kv.element_size())))
                    kvs = [kv] + [kv.clone() for _ in range(copies - 1)]
                    args = (q, k, v, kvs, batch, head_dim ** -0.5)
                    fns = {"baseline": ck._rotating(base.paged_attention, *args, rope_cache=rope),
                           "kv stream": ck._streaming(ck._turned(kvs, 1, 3)),
                           "this": ck._rotating(this.paged_attention, *args[:3], ck._turned(kvs, 2, 3), *args[4:],
                                                rope_cache=rope)}
                    us = ck._time_ab(fns, repeats, clock=time.process_time)
                    rows.append({"model": model, "dtype": dtype, "case": f"{kind} {n}", "kv_MB": kv.numel()
                                 * kv.element_size() / 1e6, "kv_copies": copies, **{f"{k}_us": t for k, t in us.items()}})
                    r = rows[-1]
                    print(f"| {model} {dtype} | {r['case']} | {r['kv_MB']:.2f} × {copies} | {r['baseline_us']:.1f} "
                          f"| {r['this_us']:.1f} | {r['this_us'] / r['baseline_us']:.2f} | {r['kv stream_us']:.1f} "
                          f"| {r['baseline_us'] / r['kv stream_us']:.2f} | {r['this_us'] / r['kv stream_us']:.2f} |",
                          flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path, help="the other kiln checkout (a source tree: kiln/, codegen/, ...)")
    ap.add_argument("--shapes", default="llama-3.2-1B,qwen2.5-0.5B,llama-3-8B", help=", ".join(ck.SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kv-mb", type=float, default=256.0, help="KV cache copies per case hold at least this many MB")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, help="torch intra-op threads, and so TVM's pool")
    ap.add_argument("--json", help="also write the raw rows here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; decode context {ck.CONTEXT}; KV block {ck.BLOCK_SIZE}; median CPU µs per call")
    print("| model | step | KV MB × copies | baseline µs | this µs | this / baseline | KV stream µs "
          "| baseline × limit | this × limit |\n|---|---|---|---|---|---|---|---|---|")
    rows = run(args.baseline, args.shapes.split(","), args.dtypes.split(","), args.kv_mb, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
