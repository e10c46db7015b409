"""Per-kernel microbenchmark of the cpu target: each apache-tvm kernel against the torch kernel it replaces.

    python benchmarks/cpu_kernels.py [--repeats 30] [--json out.json]
    python benchmarks/cpu_kernels.py --offline ART [ART ...] [--batch-sizes 1,16,64]

Builds the cpu kernel package (kernels/cpu.py, kernels/tvm.py, kernels/tvm_cpu/cpu.so) for the embedded model's
shapes (hidden 256, 8 query / 4 KV heads, head_dim 32) and a ~100 M Llama's (hidden 576, 9 / 3 heads,
head_dim 64), then times, as model.py calls them, at batch 1, 16 and 64 decode and a 128-token prefill chunk:
`paged_attention` with the fused RoPE + KV write (`rope_cache` given, as after the fuse_rope_kv_write pass),
`add_rms_norm` and `silu_mul`; and the ~100 M model's GEMMs (fp32 and bf16, batch 1/16/64 and a 128-row
prefill) through torch's F.linear against the TVM `linear` kernel, interleaved (`--gemms-only`: just those).
Prints the median µs per call and the speed-up; the kernel table in passes/kernel_selection.py
gives TVM only the kernels that win here (figures in docs/performance.md).

`--offline` instead measures whole artifacts: `kiln.LLM.generate` output tokens per second (wall and per CPU
second) at each batch size (random 128-token prompts, 64 greedy tokens each, ignore_eos; one warm-up batch
first; `--rounds N`: N rounds, the artifacts alternating, all loaded in one process), and whether the
artifact's TVM library loaded — compile a recipe once normally and once with KILN_TVM_ISA=none (torch kernels)
to compare the two on the same model.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # name -> (hidden, heads, kv_heads, head_dim, ffn)
    "embedded": (256, 8, 4, 32, 704),
    "llama-100M": (576, 9, 3, 64, 1536),
}
BLOCK_SIZE = 16
CONTEXT = 160  # decode context: a 128-token prompt and 32 generated tokens
CASES = [("decode", 1), ("decode", 16), ("decode", 64), ("prefill", 128)]


def _package(root: Path, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str = "float32",
             kernels=("tvm.paged_attention", "tvm.add_rms_norm", "tvm.silu_mul")):
    from kiln.codegen.tvm_build import write_cpu_kernels

    params = {"target": "cpu", "head_dim": head_dim, "num_heads": heads, "num_kv_heads": kv_heads,
              "block_size": BLOCK_SIZE, "dtype": dtype}
    kdir = root / f"kernels_{hidden}_{dtype}_{len(kernels)}"
    record = write_cpu_kernels(kdir, params, kernels, kiln_version="bench")
    name = f"_kiln_bench_kernels_{hidden}_{dtype}_{len(kernels)}"
    spec = importlib.util.spec_from_file_location(name, kdir / "__init__.py", submodule_search_locations=[str(kdir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    tvm = importlib.import_module(f"{name}.tvm")
    if tvm.LIBRARY is None:
        raise SystemExit(f"the TVM library did not load: {record}")
    return tvm, tvm._ref, record


def _batch(kind: str, n: int, heads: int, kv_heads: int, head_dim: int):
    from kiln.runtime.forward_batch import ForwardBatch

    seqs = [(CONTEXT - 1, 1)] * n if kind == "decode" else [(0, n)]
    max_blocks = -(-max(c + q for c, q in seqs) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(seqs) * max_blocks, generator=g).to(torch.int32)  # scattered physical blocks
    tables = order.view(len(seqs), max_blocks)
    kv = torch.randn(len(seqs) * max_blocks, 2, BLOCK_SIZE, kv_heads, head_dim, generator=g)
    positions = [p for c, q in seqs for p in range(c, c + q)]
    slots = [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for b, (c, q) in enumerate(seqs) for p in range(c, c + q)]
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    t = starts[-1]
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g)  # the fused projection model.py slices
    q = qkv[:, :heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    v = qkv[:, (heads + kv_heads) * head_dim:].unflatten(-1, (kv_heads, head_dim))
    batch = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.int32), positions=torch.tensor(positions, dtype=torch.int32),
                         query_start_loc=torch.tensor(starts, dtype=torch.int32),
                         seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32), block_tables=tables,
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         logits_indices=torch.tensor(starts[1:], dtype=torch.int32) - 1,
                         num_decodes=n if kind == "decode" else 0)
    return q, k, v, kv, batch


def _time(fn, repeats: int) -> float:
    """Median µs of `repeats` timed calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def run(repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for model, (hidden, heads, kv_heads, head_dim, ffn) in SHAPES.items():
            tvm, ref, _ = _package(Path(tmp), hidden, heads, kv_heads, head_dim)
            rope = ref.rope_cache(head_dim, 4096, 10000.0)
            for kind, n in CASES:
                q, k, v, kv, batch = _batch(kind, n, heads, kv_heads, head_dim)
                for kernel, lib in (("paged_attention", tvm), ("paged_attention", ref)):
                    call = functools.partial(lib.paged_attention, q, k, v, kv, batch, head_dim ** -0.5,
                                             rope_cache=rope)
                    us = _time(call, repeats)
                    rows.append({"model": model, "kernel": kernel, "case": f"{kind} {n}", "impl": lib.__name__, "us": us})
                x, r = torch.randn(q.shape[0], hidden), torch.randn(q.shape[0], hidden)
                w = torch.randn(hidden)
                for lib in (tvm, ref):
                    us = _time(functools.partial(lib.add_rms_norm, x, r, w, 1e-5), repeats)
                    rows.append({"model": model, "kernel": "add_rms_norm", "case": f"{kind} {n}",
                                 "impl": lib.__name__, "us": us})
                gate_up = torch.randn(q.shape[0], 2 * ffn)
                for lib in (tvm, ref):
                    us = _time(functools.partial(lib.silu_mul, gate_up), repeats)
                    rows.append({"model": model, "kernel": "silu_mul", "case": f"{kind} {n}", "impl": lib.__name__,
                                 "us": us})
    return rows


def _time_ab(fns: dict, repeats: int) -> dict:
    """Median µs per call of each of `fns`, timed interleaved (one call of each per round, after 3 warm-up
    rounds), so load that comes and goes on a shared machine hits every candidate alike."""
    for _ in range(3):
        for fn in fns.values():
            fn()
    samples: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


# the ~100 M Llama's GEMMs (K -> N): fused q/k/v, o, fused gate/up, down, and the (tied) LM head
GEMMS = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4096)]


def gemm_rows(repeats: int) -> list[dict]:
    """The ~100 M model's GEMMs at decode batch 1, 16, 64 and a 128-row prefill: torch F.linear (MKL; bf16:
    oneDNN) against the TVM `linear` kernel (packed weights), fp32 and bf16, interleaved. `GB/s` is the weight
    bytes each call reads over its time: at batch 1 the step is bound by streaming the weights."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for dtype in ("float32", "bfloat16"):
            tvm = _package(Path(tmp), 576, 9, 3, 64, dtype=dtype, kernels=("tvm.linear",))[0]
            torch_dtype = getattr(torch, dtype)
            for m in (1, 16, 64, 128):
                for k, n in GEMMS:
                    x, w = torch.randn(m, k).to(torch_dtype), (torch.randn(n, k) / k ** 0.5).to(torch_dtype)
                    us = _time_ab({"cpu": functools.partial(torch.nn.functional.linear, x, w),
                                   "tvm": functools.partial(tvm.linear, x, w)}, repeats)
                    case = f"{'decode' if m < 128 else 'prefill'} {m} [{k}->{n}]"
                    for impl, t in us.items():
                        rows.append({"model": f"llama-100M {dtype}", "kernel": "linear", "case": case, "impl": impl,
                                     "us": t, "weight_GB_s": w.numel() * w.element_size() / t / 1e3})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | kernel | step | torch µs | TVM µs | speed-up | weight GB/s, torch / TVM |",
           "|---|---|---|---|---|---|---|"]
    keyed, rate = {}, {}
    for r in rows:
        impl = r["impl"].rsplit(".", 1)[-1]
        keyed.setdefault((r["model"], r["kernel"], r["case"]), {})[impl] = r["us"]
        if "weight_GB_s" in r:
            rate.setdefault((r["model"], r["kernel"], r["case"]), {})[impl] = r["weight_GB_s"]
    for key, t in keyed.items():
        gbs = f"{rate[key]['cpu']:.1f} / {rate[key]['tvm']:.1f}" if key in rate else ""
        out.append(f"| {' | '.join(key)} | {t['cpu']:.1f} | {t['tvm']:.1f} | {t['cpu'] / t['tvm']:.1f}x | {gbs} |")
    return "\n".join(out)


def offline(artifacts: list[str], batch_sizes: list[int], prompt_len: int = 128, output_len: int = 64,
            rounds: int = 1) -> list[dict]:
    """Each artifact's LLM.generate at each batch size, all artifacts loaded in this process and timed in
    alternating rounds (order reversed every other round), so load that comes and goes hits each alike. Per
    round: output tokens per wall second and per CPU second of this process (with one thread, time lost to other
    jobs' scheduling does not count in the latter)."""
    from kiln.runtime.artifact import read_manifest

    import kiln

    llms, loaded = {}, {}
    for art in artifacts:
        llms[art] = kiln.LLM(art)
        wrapper = str(Path(art).resolve() / "kernels" / "tvm.py")
        loaded[art] = any(getattr(m, "__file__", None) == wrapper and getattr(m, "LIBRARY", None) is not None
                          for m in list(sys.modules.values()))
    vocab = read_manifest(artifacts[0])["runtime"]["vocab_size"]
    params = kiln.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in batch_sizes:
        prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
        for llm in llms.values():
            llm.generate(prompts[:max(1, n // 4)], kiln.SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for r in range(rounds):
            for art in (artifacts if r % 2 == 0 else artifacts[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                outs = llms[art].generate(prompts, params)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append({"artifact": art, "tvm": loaded[art], "batch": n, "round": r, "seconds": dt,
                             "cpu_seconds": cpu, "output_tok_s": tokens / dt, "output_tok_cpu_s": tokens / cpu})
                print(f"{art}  tvm={loaded[art]}  batch {n} round {r}: {tokens / dt:.1f} output tok/s "
                      f"({dt:.2f} s), {tokens / cpu:.1f} per CPU second", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="also write the raw rows here")
    ap.add_argument("--offline", nargs="+", metavar="ART", help="measure these artifacts' LLM.generate instead")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--gemms-only", action="store_true", help="time only the GEMMs (torch vs the TVM linear)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads, and so TVM's pool (default: torch's)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="--offline: timed rounds per batch size, artifacts alternating")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the TVM library sizes its pool from this when it loads
    if args.offline:
        rows = offline(args.offline, [int(b) for b in args.batch_sizes.split(",")], args.prompt_len, args.output_len,
                       args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    rows = ([] if args.gemms_only else run(args.repeats)) + gemm_rows(args.repeats)
    print(f"torch threads {torch.get_num_threads()}; decode context {CONTEXT}; KV block {BLOCK_SIZE}; "
          "fp32 unless the model says bf16")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
