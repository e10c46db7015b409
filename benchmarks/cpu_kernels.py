"""Per-kernel microbenchmark of the cpu target: each apache-tvm kernel against the torch kernel it replaces.

    python benchmarks/cpu_kernels.py [--repeats 30] [--json out.json]
    python benchmarks/cpu_kernels.py --offline ART [ART ...] [--batch-sizes 1,16,64]
    python benchmarks/cpu_kernels.py --streaming [--rows 1,2,4] [--passes 10]
    python benchmarks/cpu_kernels.py --step-profile ART [--batch-sizes 1,16]
    python benchmarks/cpu_kernels.py --sampler

Builds the cpu kernel package (kernels/cpu.py, kernels/tvm.py, kernels/tvm_cpu/cpu.so) for the embedded model's
shapes (hidden 256, 8 query / 4 KV heads, head_dim 32) and a ~100 M Llama's (hidden 576, 9 / 3 heads,
head_dim 64) — `--shapes` adds Llama-3.2-1B's, Qwen2.5-0.5B's and Llama-3-8B's (SHAPES), `--dtypes` bf16 — then
times, as model.py calls them, at batch 1, 16 and 64 decode and a 128-token prefill chunk:
`paged_attention` with the fused RoPE + KV write (`rope_cache` given, as after the fuse_rope_kv_write pass),
`add_rms_norm`, `rms_norm` and `silu_mul` (`--kv-copies N` / `--kv-mb MB`: attention over N KV caches, or as many
as hold MB, in turn, as a model's layers, so that a large batch's KV comes from DRAM, not the L2; each attention
row also times a torch.sum over the same KV bytes, its streaming limit); and the ~100 M model's GEMMs (fp32 and
bf16, batch 1/16/64 and a 128-row prefill) through torch's F.linear against the TVM `linear` kernel, interleaved
(`--gemms-only`: just those). benchmarks/attention_ab.py times one checkout's attention against another's.
Prints the median µs per call and the speed-up; the kernel table in passes/kernel_selection.py
gives TVM only the kernels that win here (figures in docs/performance.md).

`--offline` instead measures whole artifacts: `kiln.LLM.generate` output tokens per second (wall and per CPU
second) at each batch size (random 128-token prompts, 64 greedy tokens each, ignore_eos; one warm-up batch
first; `--rounds N`: N rounds, the artifacts alternating, all loaded in one process), and whether the
artifact's TVM library loaded — compile a recipe once normally and once with KILN_TVM_ISA=none (torch kernels)
to compare the two on the same model.

`--streaming` times the small-M GEMMs where decode is bound, on a whole step's weights (434 MB, from DRAM)
against the weight-streaming limit benchmarks/cpu_peer.py measures (see `streaming_rows`).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # name -> (hidden, heads, kv_heads, head_dim, ffn)
    "embedded": (256, 8, 4, 32, 704),
    "llama-100M": (576, 9, 3, 64, 1536),
    "llama-3.2-1B": (2048, 32, 8, 64, 8192),  # GQA group 4, head_dim 64
    "qwen2.5-0.5B": (896, 14, 2, 64, 4864),  # group 7
    "llama-3-8B": (4096, 32, 8, 128, 14336),  # group 4, head_dim 128
}
DEFAULT_SHAPES = ("embedded", "llama-100M")  # the per-kernel table's models unless --shapes names others
BLOCK_SIZE = 16
CONTEXT = 160  # decode context: a 128-token prompt and 32 generated tokens
CASES = [("decode", 1), ("decode", 16), ("decode", 64), ("prefill", 128)]


def _package(root: Path, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str = "float32",
             kernels=("tvm.paged_attention", "tvm.add_rms_norm", "tvm.silu_mul"), gemms: str | None = None):
    """The kernel package for these shapes, imported. `gemms` ("tvm" / "onednn"): who runs a bf16 library's
    packed GEMMs in this package, whatever this host's choice (kiln.runtime.tvm_kernels.bf16_gemm_backend)."""
    from kiln.codegen.tvm_build import write_cpu_kernels
    from kiln.runtime import tvm_kernels

    params = {"target": "cpu", "head_dim": head_dim, "num_heads": heads, "num_kv_heads": kv_heads,
              "block_size": BLOCK_SIZE, "dtype": dtype}
    tag = f"{hidden}_{dtype}_{len(kernels)}" + (f"_{gemms}" if gemms else "")
    kdir = root / f"kernels_{tag}"
    record = write_cpu_kernels(kdir, params, kernels, kiln_version="bench")
    saved = list(tvm_kernels._bf16_choice)
    if gemms:
        tvm_kernels._bf16_choice[:] = [gemms]
    try:
        tvm = import_package(kdir, f"_kiln_bench_kernels_{tag}")
    finally:
        tvm_kernels._bf16_choice[:] = saved
    return tvm, tvm._ref, record


def import_package(kdir: Path, name: str):
    """The kernel package written at `kdir` (write_cpu_kernels), imported as `name`: its `tvm` module, whose
    library must have loaded."""
    spec = importlib.util.spec_from_file_location(name, kdir / "__init__.py", submodule_search_locations=[str(kdir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    tvm = importlib.import_module(f"{name}.tvm")
    if tvm.LIBRARY is None:
        raise SystemExit(f"the TVM library in {kdir} did not load (why: its tvm_cpu/build.json)")
    return tvm


def _batch(kind: str, n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32):
    from kiln.runtime.forward_batch import ForwardBatch

    seqs = [(CONTEXT - 1, 1)] * n if kind == "decode" else [(0, n)]
    max_blocks = -(-max(c + q for c, q in seqs) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(seqs) * max_blocks, generator=g).to(torch.int32)  # scattered physical blocks
    tables = order.view(len(seqs), max_blocks)
    kv = torch.randn(len(seqs) * max_blocks, 2, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype)
    positions = [p for c, q in seqs for p in range(c, c + q)]
    slots = [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for b, (c, q) in enumerate(seqs) for p in range(c, c + q)]
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    t = starts[-1]
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)  # the fused projection model.py slices
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


def run(repeats: int, only: set[str] | None = None, kv_copies: int = 1, shapes=DEFAULT_SHAPES,
        dtypes=("float32",), kv_mb: float = 0.0) -> list[dict]:
    """Each kernel (or those in `only`) at each CASE on each of `shapes` and `dtypes`: TVM and torch timed
    interleaved. With `kv_copies` > 1 each paged_attention call takes the next of that many copies of the KV cache,
    as a model's layers each read their own: a decode-64 cache is 10.5 MB (embedded), so 24 copies stream from
    DRAM; `kv_mb` raises the count per case until the copies hold that many MB (256: 8x a 32 MiB L3).

    paged_attention is timed against its KV-streaming limit, interleaved with it: `kv stream` is a torch.sum over
    the same bytes of the next cache (every block the step reads; a bf16 cache summed as fp32 words, so both
    dtypes stream at the fp32 sum's pace rather than torch's bf16 reduction's)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for model in shapes:
            hidden, heads, kv_heads, head_dim, ffn = SHAPES[model]
            for dtype in dtypes:
                torch_dtype = getattr(torch, dtype)
                kernels = tuple(k for k in ("tvm.paged_attention", "tvm.add_rms_norm", "tvm.rms_norm", "tvm.silu_mul")
                                if not only or k.removeprefix("tvm.") in only)
                tvm, ref, _ = _package(Path(tmp), hidden, heads, kv_heads, head_dim, dtype=dtype, kernels=kernels)
                rope = ref.rope_cache(head_dim, 4096, 10000.0)
                label = model if dtypes == ("float32",) else f"{model} {dtype}"
                for kind, n in CASES:
                    q, k, v, kv, batch = _batch(kind, n, heads, kv_heads, head_dim, torch_dtype)
                    x, r = torch.randn(q.shape[0], hidden).to(torch_dtype), torch.randn(q.shape[0], hidden).to(torch_dtype)
                    w, gate_up = torch.randn(hidden).to(torch_dtype), torch.randn(q.shape[0], 2 * ffn).to(torch_dtype)
                    copies = max(kv_copies, math.ceil(kv_mb * 1e6 / (kv.numel() * kv.element_size())))
                    kvs = [kv] + [kv.clone() for _ in range(copies - 1)]
                    calls = {  # kernel -> (args, keywords) as model.py passes them
                        "paged_attention": ((q, k, v, kvs, batch, head_dim ** -0.5), {"rope_cache": rope}),
                        "add_rms_norm": ((x, r, w, 1e-5), {}),
                        "rms_norm": ((x, w, 1e-5), {}),
                        "silu_mul": ((gate_up,), {}),
                    }
                    for kernel, (args, kw) in calls.items():
                        if only and kernel not in only:
                            continue
                        if kernel == "paged_attention":  # each reads other caches than the previous call did
                            fns = {tvm.__name__: _rotating(tvm.paged_attention, *args, **kw),
                                   ref.__name__: _rotating(ref.paged_attention, *args[:3], _turned(kvs, 1, 3),
                                                           *args[4:], **kw),
                                   "kv stream": _streaming(_turned(kvs, 2, 3))}
                        else:
                            fns = {lib.__name__: functools.partial(getattr(lib, kernel), *args, **kw) for lib in (tvm, ref)}
                        us = _time_ab(fns, repeats)
                        extra = ({"kv_MB": kv.numel() * kv.element_size() / 1e6, "kv_copies": copies}
                                 if kernel == "paged_attention" else {})
                        rows += [{"model": label, "kernel": kernel, "case": f"{kind} {n}", "impl": impl, "us": t, **extra}
                                 for impl, t in us.items()]
    return rows


def _turned(kv_caches: list, i: int, n: int) -> list:
    """`kv_caches` starting i/n of the way along: candidates timed in turn over the same copies, each from its own
    offset, read a cache the previous candidate read 1/n of the copies ago (out of the L3 with --kv-mb 256), not
    the one it has just brought in."""
    start = i * len(kv_caches) // n
    return kv_caches[start:] + kv_caches[:start]


def _streaming(kv_caches: list):
    """A torch.sum over the next of `kv_caches` in turn (as fp32 words): the time to stream its bytes once."""
    words = itertools.cycle([kv.view(torch.float32) for kv in kv_caches])
    return lambda: torch.sum(next(words))


def _rotating(fn, q, k, v, kv_caches: list, *args, **kw):
    """fn(q, k, v, kv_cache, ...) over `kv_caches` in turn, one per call."""
    caches = itertools.cycle(kv_caches)
    return lambda: fn(q, k, v, next(caches), *args, **kw)


def _time_ab(fns: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Median µs per call of each of `fns`, timed interleaved (one call of each per round, after 3 warm-up
    rounds), so load that comes and goes on a shared machine hits every candidate alike. `clock`:
    time.process_time for CPU time (with one thread, time other jobs hold the core does not count)."""
    for _ in range(3):
        for fn in fns.values():
            fn()
    samples: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


# the ~100 M Llama's GEMMs (K -> N): fused q/k/v, o, fused gate/up, down, and the (tied) LM head
GEMMS = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4096)]


def _gemm_packages(root: Path, dtype: str) -> dict:
    """Packed-GEMM candidates -> their kernel package: the TVM `linear`; for bf16 also oneDNN over prepacked
    weights where this torch and CPU have its bf16 matmul."""
    from kiln.runtime.tvm_kernels import onednn_bf16_available

    names = ["tvm"] + (["onednn"] if dtype == "bfloat16" and onednn_bf16_available() else [])
    return {g: _package(root, 576, 9, 3, 64, dtype=dtype, kernels=("tvm.linear",), gemms=g)[0] for g in names}


def gemm_rows(repeats: int) -> list[dict]:
    """The ~100 M model's GEMMs at decode batch 1, 16, 64 and a 128-row prefill: torch F.linear over the weight as
    stored (MKL; bf16: oneDNN, which re-lays the weight out every call) against the TVM `linear` kernel (packed
    weights) and, bf16 on a CPU with oneDNN's bf16 matmul, oneDNN over weights prepacked once (what a bf16 artifact
    runs there), fp32 and bf16, interleaved. `GB/s` is the weight bytes each call reads over its time: at batch 1
    the step is bound by streaming the weights."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for dtype in ("float32", "bfloat16"):
            packages = _gemm_packages(Path(tmp), dtype)
            torch_dtype = getattr(torch, dtype)
            for m in (1, 16, 64, 128):
                for k, n in GEMMS:
                    x, w = torch.randn(m, k).to(torch_dtype), (torch.randn(n, k) / k ** 0.5).to(torch_dtype)
                    us = _time_ab({"cpu": functools.partial(torch.nn.functional.linear, x, w),
                                   **{g: functools.partial(lib.linear, x, lib.pack_weight(w))
                                      for g, lib in packages.items()}}, repeats)
                    case = f"{'decode' if m < 128 else 'prefill'} {m} [{k}->{n}]"
                    for impl, t in us.items():
                        rows.append({"model": f"llama-100M {dtype}", "kernel": "linear", "case": case, "impl": impl,
                                     "us": t, "weight_GB_s": w.numel() * w.element_size() / t / 1e3})
    return rows


# one decode step's matrices of the ~100 M Llama (fused q/k/v, o, fused gate/up, down per layer; the tied LM head)
STEP_LAYERS = 30
STEP_MATRICES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def streaming_rows(rows_list: list[int], passes: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[dict]:
    """Every matrix one decode step of the ~100 M Llama reads (30 layers + the LM head: 434 MB in fp32, distinct
    tensors, so they stream from DRAM, not the L3), one pass after another, the candidates alternating per pass:
    `limit` = one torch.mv per matrix (benchmarks/cpu_peer.py's weight-streaming limit), `read` = a torch.sum
    over each matrix (reading it and nothing else), then for each row count M torch's F.linear and the TVM
    `linear` over the packed weights. Reports ms per pass (wall, and CPU time of this process: with one thread,
    time other jobs hold the core does not count) and the weight bytes streamed per second.

    `x_limit` = CPU ms / the limit's CPU ms for that dtype. The bf16 limit is the fp32 `torch.mv` pass of the
    same run over half the bytes (the same bandwidth): torch's own bf16 mv converts in software on a CPU without
    AVX512-BF16 and is no measure of what the memory allows (without an fp32 run: the bf16 torch.mv)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for dtype in dtypes:
            out += _stream(_gemm_packages(Path(tmp), dtype), getattr(torch, dtype), rows_list, passes)
    mv = {r["dtype"]: r["cpu_ms_median"] for r in out if r["candidate"] == "limit (torch.mv)"}
    limits = {**mv, **({"bfloat16": mv["float32"] / 2} if "float32" in mv else {})}
    for r in out:
        r["limit_cpu_ms"] = limits[r["dtype"]]
        r["x_limit"] = r["cpu_ms_median"] / limits[r["dtype"]]
    return out


def _stream(packages: dict, dtype: torch.dtype, rows_list: list[int], passes: int) -> list[dict]:
    shapes = [(k, n) for _ in range(STEP_LAYERS) for k, n in STEP_MATRICES] + [(576, 4096)]
    g = torch.Generator().manual_seed(0)
    mats = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for k, n in shapes]
    packed = {name: [lib.pack_weight(w) for w in mats] for name, lib in packages.items()}
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    xs = {m: {k: torch.randn(m, k).to(dtype) for k in {576, 1536}} for m in rows_list}
    vec = {k: torch.randn(k).to(dtype) for k in {576, 1536}}
    ys = [torch.empty(w.shape[0], dtype=dtype) for w in mats]

    def limit():
        for w, y in zip(mats, ys, strict=True):
            torch.mv(w, vec[w.shape[1]], out=y)

    def read():
        for w in mats:
            w.sum()

    def torch_rows(m):
        for w in mats:
            torch.nn.functional.linear(xs[m][w.shape[1]], w)

    def packed_rows(name, m):
        for w in packed[name]:
            packages[name].linear(xs[m][w.shape[1]], w)

    fns = {"limit (torch.mv)": limit, "read (torch.sum)": read}
    for m in rows_list:
        fns[f"torch M={m}"] = functools.partial(torch_rows, m)
        for name in packages:
            fns[f"{name} M={m}"] = functools.partial(packed_rows, name, m)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up pass
        fn()
    for _ in range(passes):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            samples[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = []
    for name, ts in samples.items():
        best, med, cpu_med = min(ts), statistics.median(ts), statistics.median(cpu[name])
        out.append({"dtype": str(dtype).removeprefix("torch."), "candidate": name, "weight_MB": nbytes / 1e6,
                    "passes": passes, "ms_best": best * 1e3, "ms_median": med * 1e3, "cpu_ms_median": cpu_med * 1e3,
                    "GB_s_best": nbytes / best / 1e9, "GB_s_median": nbytes / med / 1e9,
                    "GB_s_per_cpu_s": nbytes / cpu_med / 1e9})
    return out


def streaming_table(rows: list[dict]) -> str:
    out = ["| dtype | candidate | weights MB | ms per pass, best / median | CPU ms, median | GB/s, best / median "
           "| GB per CPU second | × the dtype's limit (CPU ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['candidate']} | {r['weight_MB']:.0f} | {r['ms_best']:.1f} / "
                   f"{r['ms_median']:.1f} | {r['cpu_ms_median']:.1f} | {r['GB_s_best']:.1f} / {r['GB_s_median']:.1f} "
                   f"| {r['GB_s_per_cpu_s']:.1f} | {r['x_limit']:.2f}× of {r['limit_cpu_ms']:.1f} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    """torch (`cpu`) against TVM, against oneDNN over prepacked weights where a bf16 GEMM row has it, and an
    attention row against the KV-streaming limit where it has one."""
    out = ["| model | kernel | step | torch µs | TVM µs | oneDNN prepacked µs | speed-up (TVM; oneDNN) "
           "| weight GB/s, torch / TVM / oneDNN | KV MB × copies | KV stream µs | TVM × the KV-streaming limit |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed, rate, kv = {}, {}, {}
    for r in rows:
        impl = r["impl"].rsplit(".", 1)[-1]
        key = (r["model"], r["kernel"], r["case"])
        keyed.setdefault(key, {})[impl] = r["us"]
        if "weight_GB_s" in r:
            rate.setdefault(key, {})[impl] = r["weight_GB_s"]
        if "kv_MB" in r:
            kv[key] = (r["kv_MB"], r["kv_copies"])
    for key, t in keyed.items():
        gbs = " / ".join(f"{rate[key][i]:.1f}" for i in ("cpu", "tvm", "onednn") if i in rate[key]) if key in rate else ""
        one = t.get("onednn")
        ups = f"{t['cpu'] / t['tvm']:.1f}x" + (f"; {t['cpu'] / one:.1f}x" if one else "")
        limit = (f"{kv[key][0]:.2f} × {kv[key][1]} | {t['kv stream']:.1f} | {t['tvm'] / t['kv stream']:.2f}"
                 if "kv stream" in t else " | | ")
        out.append(f"| {' | '.join(key)} | {t['cpu']:.1f} | {t['tvm']:.1f} | {f'{one:.1f}' if one else ''} "
                   f"| {ups} | {gbs} | {limit} |")
    return "\n".join(out)


def offline(artifacts: list[str], batch_sizes: list[int], prompt_len: int = 128, output_len: int = 64,
            rounds: int = 1) -> list[dict]:
    """Each artifact's LLM.generate at each batch size, all artifacts loaded in this process and timed in
    alternating rounds (order reversed every other round), so load that comes and goes hits each alike. Per
    round: output tokens per wall second and per CPU second of this process (with one thread, time lost to other
    jobs' scheduling does not count in the latter)."""
    from kiln.runtime.manifest import read_manifest

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


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_p before the candidates path: every row sorted whole (the baseline `--sampler` times)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))


def sampler_rows(repeats: int) -> list[dict]:
    """The sampler's top-p on [B, V] logits (rows as peaked as an LM's: randn * 6), whole-row sort (before)
    against runtime/core/sampler.py's apply_top_p (after), interleaved; and the greedy path's row max for scale."""
    from kiln.runtime.core.sampler import apply_top_p

    rows = []
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for vocab in (4096, 32000, 128256):
            for b in (1, 16, 64):
                logits = torch.randn(b, vocab, generator=g) * 6
                top_p = torch.full((b,), 0.9)
                us = _time_ab({"sort": functools.partial(_top_p_by_sort, logits, top_p),
                               "candidates": functools.partial(apply_top_p, logits, top_p),
                               "greedy max": functools.partial(logits.max, dim=-1)}, repeats)
                rows += [{"model": f"vocab {vocab}", "kernel": "top_p", "case": f"batch {b}", "impl": impl, "us": t}
                         for impl, t in us.items()]
    return rows


def step_profile(art: str, batch: int, prompt_len: int, output_len: int) -> dict:
    """Where a decode step of `art` goes: `kiln.LLM.generate` of `batch` random prompts, every kernel call
    model.py makes (`K.<name>(...)`) and the forward itself timed by wrappers; only steps that are all decodes
    count. Returns ms per decode step: the engine step (wall time of generate / steps, prefill excluded), the
    forward, each kernel, and the forward's time outside the kernel calls (model.py's own Python)."""
    import re
    from collections import defaultdict

    from kiln.runtime.manifest import read_manifest

    import kiln

    llm = kiln.LLM(art, max_num_seqs=batch)
    model = llm.engine.runner.model
    K = sys.modules[type(model).__module__].K
    names = sorted(set(re.findall(r"\bK\.(\w+)\(", (Path(art) / "model.py").read_text())))
    spent: dict[str, float] = defaultdict(float)
    state = {"decode": False, "steps": 0}

    def timed(name, fn):
        def call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if state["decode"]:
                    spent[name] += time.perf_counter() - t0
        return call

    for name in names:
        setattr(K, name, timed(name, getattr(K, name)))
    forward = model.forward

    def forward_timed(fb, kv_caches, *a, **kw):
        state["decode"] = fb.num_decodes == fb.input_ids.numel()
        t0 = time.perf_counter()
        try:
            return forward(fb, kv_caches, *a, **kw)
        finally:
            if state["decode"]:
                spent["forward"] += time.perf_counter() - t0
                state["steps"] += 1
            state["decode"] = False

    model.forward = forward_timed
    vocab = read_manifest(art)["runtime"]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    llm.generate(prompts, kiln.SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    spent.clear()
    state["steps"] = 0
    llm.generate(prompts, kiln.SamplingParams(max_tokens=1, ignore_eos=True))  # the prefill alone
    t0 = time.perf_counter()
    llm.generate(prompts, kiln.SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    spent.clear()
    state["steps"] = 0
    t0 = time.perf_counter()
    llm.generate(prompts, kiln.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0 - prefill
    steps = max(1, state["steps"])
    per_step = {name: t * 1e3 / steps for name, t in sorted(spent.items(), key=lambda kv: -kv[1])}
    kernels = sum(v for k, v in per_step.items() if k != "forward")
    return {"artifact": art, "batch": batch, "decode_steps": steps, "step_ms": wall * 1e3 / steps,
            "forward_ms": per_step.get("forward", 0.0), "model_py_ms": per_step.get("forward", 0.0) - kernels,
            "kernels_ms": {k: v for k, v in per_step.items() if k != "forward"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="also write the raw rows here")
    ap.add_argument("--offline", nargs="+", metavar="ART", help="measure these artifacts' LLM.generate instead")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--gemms-only", action="store_true", help="time only the GEMMs (torch vs the TVM linear)")
    ap.add_argument("--streaming", action="store_true",
                    help="a decode step's weights streamed from DRAM: torch.mv (the limit) vs the GEMMs at --rows")
    ap.add_argument("--rows", default="1,2,4", help="--streaming: rows (decode batch sizes) to time")
    ap.add_argument("--passes", type=int, default=10, help="--streaming: timed passes per candidate")
    ap.add_argument("--step-profile", metavar="ART", help="where a decode step of ART goes, per kernel call")
    ap.add_argument("--sampler", action="store_true", help="time the sampler's top-p, before/after")
    ap.add_argument("--only", help="comma-separated kernels of the per-kernel table to time (default: all)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads, and so TVM's pool (default: torch's)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="--offline: timed rounds per batch size, artifacts alternating")
    ap.add_argument("--kv-copies", type=int, default=1,
                    help="paged_attention cycles over this many KV caches (a model's layers): 24 puts decode 64 in DRAM")
    ap.add_argument("--kv-mb", type=float, default=0.0,
                    help="at least as many KV cache copies as hold this many MB per case (256: 8x a 32 MiB L3)")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"models of the per-kernel table: {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="float32", help="per-kernel table dtypes: float32, bfloat16 or both")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the TVM library sizes its pool from this when it loads
    if args.offline:
        rows = offline(args.offline, [int(b) for b in args.batch_sizes.split(",")], args.prompt_len, args.output_len,
                       args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    if args.sampler:
        rows = sampler_rows(args.repeats)
        print(f"torch threads {torch.get_num_threads()}; median µs per call")
        for r in rows:
            print(f"| {r['model']} | {r['case']} | {r['impl']} | {r['us']:.1f} |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    if args.step_profile:
        for b in [int(b) for b in args.batch_sizes.split(",")]:
            r = step_profile(args.step_profile, b, args.prompt_len, args.output_len)
            print(f"batch {b}: {r['decode_steps']} decode steps, {r['step_ms']:.2f} ms per step (engine), forward "
                  f"{r['forward_ms']:.2f} ms, model.py's own Python {r['model_py_ms']:.2f} ms")
            for name, ms in r["kernels_ms"].items():
                print(f"    {name:28s} {ms:8.3f} ms  {ms / r['step_ms']:6.1%}")
        return 0
    if args.streaming:
        rows = streaming_rows([int(m) for m in args.rows.split(",")], args.passes)
        print(f"torch threads {torch.get_num_threads()}")
        print(streaming_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    only = set(args.only.split(",")) if args.only else None
    rows = ([] if args.gemms_only else run(args.repeats, only, args.kv_copies, tuple(args.shapes.split(",")),
                                          tuple(args.dtypes.split(",")), args.kv_mb))
    rows += [] if only else gemm_rows(args.repeats)
    print(f"torch threads {torch.get_num_threads()}; decode context {CONTEXT}; KV block {BLOCK_SIZE}; "
          f"KV caches in turn: at least {args.kv_copies}, at least {args.kv_mb:g} MB; fp32 unless the model says bf16")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
