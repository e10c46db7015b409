"""kiln against vLLM's CPU build, served on the same CPU cores, with the engine's and the memory's limits.

    python benchmarks/cpu_peer.py --vllm-python /work/peer/vllm-venv/bin/python     # the real run
    python benchmarks/cpu_peer.py                                                    # kiln only
    python benchmarks/cpu_peer.py --tiny --out-dir /tmp/x                            # smoke (CI): ~20 s

For each checkpoint (`--checkpoints`, default `random,embedded`):
  * `random`: a ~108 M-parameter random Llama built offline with transformers (hidden 576, 30 layers, 9 q / 3 kv
    heads, head_dim 64, ffn 1536, tied embeddings, max_position 512, fp32 safetensors), with the embedded
    model's tokenizer files (vocab 4096, ChatML chat template) so that both servers tokenize identically;
    `embedded`: examples/embedded as it is; `tiny` (`--tiny`): the `random` recipe at hidden 64, 2 layers.
    Each is compiled for kiln with `kiln recipe from-hf CKPT --target cpu --dtype DTYPE` + `kiln compile`
    (`--dtype`, default fp32; bf16: the fp32 checkpoint's weights stored as bf16 by the compiler, and vLLM
    started with `--dtype bfloat16`, which casts them at load: both servers hold the same bf16 weights).
  * the weight-streaming limit: one fp32 matrix-vector product (torch.mv) per weight matrix a decode step reads
    (every 2-D tensor; the embedding table only when it doubles as the lm_head), timed in a loop on the
    benchmark's cores -> bytes/s and the best-case batch-1 decode step (`stream_ms`, 1000 / stream_ms tok/s).
    A model smaller than the L3 (the embedded one: 22 MB) streams from cache, not DRAM. With `--dtype bf16` the
    limit is the same loop's bandwidth over the bf16 bytes (half): torch's bf16 mv on a CPU without AVX512-BF16
    converts in software and would understate what the memory allows.
  * kiln's offline throughput: `LLM.generate` over the same workload (the same number of random-token prompts,
    same lengths, greedy, ignore_eos) with at most B sequences at once (max_num_seqs=B), B = each concurrency;
    batch 1 runs `--offline-b1-prompts` prompts (its rate does not depend on the count).
  * served, `--rounds` rounds, servers alternating (kiln then vLLM, then vLLM then kiln, ...; never both up):
    start the server (its own process group, pinned to `--cores`), wait for /health and /v1/models within a
    bound, send 2 warm-up requests, then at each concurrency run vLLM's own `bench serve` client (when
    `--vllm-python` is given: `vllm.benchmarks.serve.main_async` in the vLLM venv, random dataset, fixed
    lengths, `--ignore-eos --temperature 0 --seed S`) and kiln's `kiln bench serve` client (`kiln.bench.run_serve`,
    random token ids, greedy, ignore_eos) as a cross-check; kill the server's process group in `finally`.
  * prompts: every measured run (offline at each batch size, each served (round, concurrency, client)) has
    prompts of its own and every warm-up prompts no measured run uses (`run_seed`, `warmup_seed`), so that no
    run is served from a prefix cache a warm-up or an earlier run filled (before 2026-12-02 they repeated, and
    whichever run came later skipped its prefills: served/offline ratios above 1 came from that).
  * `--profile-concurrency C` (default 16, 0 = off): kiln's server under kiln's client at C, sampled by py-spy
    (`--py-spy PATH`, else `py-spy` on PATH) for `--profile-seconds`; the top frames go into the JSON.

Threads: both servers get the same cores (`--cores`, default all): vLLM `VLLM_CPU_OMP_THREADS_BIND=<cores>`, kiln
`OMP_NUM_THREADS=len(cores)` (torch's intra-op pool); both process trees are pinned to the cores with
sched_setaffinity. KV space: `--kv-gib` for both (vLLM `VLLM_CPU_KVCACHE_SPACE`, kiln `--num-kv-blocks`).
`--compute-cores` (within `--cores`) are the cores the engines compute on: kiln's engine core (`kiln serve
--core-cpus`, its API server then on the rest of `--cores`), vLLM's OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`;
its API server and engine-core processes float within `--cores`), and the offline and streaming workers.
The clients run on the same cores unless `--client-cores` gives them others. On a 2-core box,
`--cores 0-1 --compute-cores 0 --client-cores 1` is each engine computing on core 0 with one thread, offline
and served alike, and the front-ends and the load generators on core 1 (vLLM's CPU default reserves a core for
its front-end the same way): a served/offline ratio that measures what serving costs the engine's cores, not
what the client's own parsing takes from them.

Prints the ratio table and writes one small JSON per run: OUT_DIR/cpu_peer-<UTC time>.json (default OUT_DIR:
benchmarks/results/<UTC date>-cpu/). Checkpoints, artifacts and server logs go under `--work-dir`
(default build/bench/peer, ignored by git) and are reused while unchanged.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import EMBEDDED_CKPT, REPO, _stale  # noqa: E402

# Shapes of the random checkpoints (Llama; the vocabulary is the embedded tokenizer's).
MODELS = {
    "random": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=64, intermediate_size=1536),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SERVED_NAME = "m"
READY_TIMEOUT_S = {"kiln": 300.0, "vllm": 900.0}  # vLLM compiles the model at start (7 min seen)
CLIENT_TIMEOUT_S = 3600.0
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> vLLM's --dtype
WARMUP_OUTPUT_LEN = 8


def warmup_seed(seed: int) -> int:
    """The warm-ups' prompts: a seed no measured run uses. Measured runs each get prompts of their own (the run's
    seed, `run_seed`), so no run finds its prompts in a prefix cache that a warm-up or an earlier run filled: the
    servers and offline `LLM.generate` all prefill every prompt they measure."""
    return seed + 1_000_003


def run_seed(seed: int, rnd: int, concurrency_index: int, client_index: int) -> int:
    """A measured served run's prompts: distinct for every (round, concurrency, client)."""
    return seed + 1 + 1000 * rnd + 10 * concurrency_index + client_index
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

# vLLM's `bench serve` without the `vllm` CLI (whose version lookup fails for the `vllm-cpu` distribution).
VLLM_CLIENT = """
import asyncio, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main_async
parser = FlexibleArgumentParser()
add_cli_args(parser)
asyncio.run(main_async(parser.parse_args(sys.argv[1:])))
"""


def log(msg: str) -> None:
    print(f"[cpu_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Checkpoints and artifacts --------------------------------------------------------------------------------
def build_random_checkpoint(out: Path, shape: dict[str, int], seed: int = 0) -> Path:
    """A random Llama in fp32 safetensors with config.json, generation_config.json and the embedded model's
    tokenizer (and chat template). Reused when present."""
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = json.loads((EMBEDDED_CKPT / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=ref["vocab_size"], max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=ref["bos_token_id"],
                      eos_token_id=ref["eos_token_id"], pad_token_id=ref.get("pad_token_id"), **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_CKPT / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    return out


def kiln_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kiln.cli", *args], check=True, cwd=REPO,
                   env={**os.environ, **OFFLINE_ENV})


def compile_for_kiln(ckpt: Path, work: Path, dtype: str = "fp32") -> Path:
    """`kiln recipe from-hf CKPT --target cpu --dtype DTYPE` then `kiln compile`; reused while fresh."""
    recipe, art = work / "recipe.dsl", work / "artifact"
    if _stale(art, ckpt):
        work.mkdir(parents=True, exist_ok=True)
        kiln_cli("recipe", "from-hf", str(ckpt), "--target", "cpu", "--dtype", dtype, "-o", str(recipe))
        kiln_cli("compile", str(recipe), "-o", str(art), "--no-progress")
    return art


def checkpoint(name: str, work_dir: Path) -> Path:
    if name == "embedded":
        return EMBEDDED_CKPT
    return build_random_checkpoint(work_dir / name / "ckpt", MODELS[name])


def param_count(ckpt: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            total += sum(math.prod(sf.get_slice(key).get_shape()) for key in sf.keys())
    return total


# Workers (run in their own process, pinned to the cores) --------------------------------------------------
def _pin(cores: list[int], threads: int) -> None:
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(threads)


def stream_worker(ckpt: Path, min_time: float, dtype: str = "fp32") -> dict[str, Any]:
    """The weight-streaming limit: y = W @ x (fp32 torch.mv) for every matrix a decode step reads, in a loop. For
    bf16 the limit is the bf16 bytes at the bandwidth that loop reached (`pass_ms_*` scaled by the byte ratio;
    the fp32 loop's own figures are kept as `fp32_pass_ms_*`)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    has_head = any(k.endswith("lm_head.weight") for k in tensors)
    # decode gathers one row of the embedding table; it is read whole only as the (tied) lm_head
    mats = [t.float().contiguous() for k, t in sorted(tensors.items())
            if t.dim() == 2 and not (has_head and k.endswith("embed_tokens.weight"))]
    del tensors
    xs = {k: torch.randn(k) for k in {m.shape[1] for m in mats}}
    ys = [torch.empty(m.shape[0]) for m in mats]
    nbytes = sum(m.numel() * m.element_size() for m in mats)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for m, y in zip(mats, ys):
            torch.mv(m, xs[m.shape[1]], out=y)
        return time.perf_counter() - t0

    for _ in range(3):
        one_pass()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 10 or time.perf_counter() - start < min_time:
        times.append(one_pass())
    best, med = min(times), statistics.median(times)
    out = {"matrices": len(mats), "weight_bytes": nbytes, "passes": len(times), "pass_ms_best": best * 1e3,
           "pass_ms_median": med * 1e3, "bandwidth_gb_s_best": nbytes / best / 1e9,
           "bandwidth_gb_s_median": nbytes / med / 1e9, "limit_tok_s_batch1": 1.0 / best,
           "torch_threads": torch.get_num_threads(), "dtype": dtype}
    if dtype == "bf16":  # the same bandwidth over half the bytes
        out.update({f"fp32_{k}": out[k] for k in ("weight_bytes", "pass_ms_best", "pass_ms_median")},
                   weight_bytes=nbytes // 2, pass_ms_best=best * 500, pass_ms_median=med * 500,
                   limit_tok_s_batch1=2.0 / best)
    return out


def offline_worker(art: Path, batches: list[int], num_prompts: int, b1_prompts: int, input_len: int,
                   output_len: int, num_kv_blocks: int, seed: int) -> dict[str, Any]:
    """kiln's `LLM.generate` on the served workload, at most B sequences at once, after a short warm-up."""
    import torch
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    from kiln.bench import make_requests

    vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for b in batches:
        n = min(num_prompts, b1_prompts) if b == 1 else num_prompts
        prompts = [s.prompt for s in make_requests(n, input_len=input_len, output_len=output_len,
                                                   vocab_size=vocab, seed=seed)]
        warm = [s.prompt for s in make_requests(b, input_len=input_len, output_len=WARMUP_OUTPUT_LEN,
                                                vocab_size=vocab, seed=warmup_seed(seed))]
        llm = LLM(str(art), max_num_seqs=b, num_kv_blocks=num_kv_blocks, seed=seed)
        llm.generate(warm, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True))  # one wave, other prompts
        t0, c0 = time.perf_counter(), _own_cpu()
        outs = llm.generate(prompts, params)
        dt, cpu = time.perf_counter() - t0, _own_cpu() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"batch": b, "prompts": n, "output_tokens": tokens, "duration_s": dt,
                     "out_tok_s": tokens / dt, "cpu_ms_per_token": cpu / tokens * 1e3})
        del llm
    return {"rows": rows, "torch_threads": torch.get_num_threads()}


def _own_cpu(who: int = resource.RUSAGE_SELF) -> float:
    """CPU seconds (user + system) of this process's threads, or of its waited-for children."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["ckpt"], dtype=spec["dtype"], max_num_seqs=spec["batch"], max_model_len=spec["max_model_len"],
          seed=spec["seed"])
prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
warm = [{"prompt_token_ids": p} for p in spec["warmup_prompts"]]
llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
dt = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
json.dump({"batch": spec["batch"], "prompts": len(prompts), "output_tokens": n, "duration_s": dt,
           "out_tok_s": n / dt}, open(spec["out"], "w"))
"""


def vllm_offline(ckpt: Path, vocab: int, args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    """vLLM's `LLM.generate` on the served workload (kiln's prompt token ids), a fresh process per batch size,
    pinned to `--cores` like its server: its throughput, for vLLM's own served/offline."""
    from kiln.bench import make_requests

    rows = []
    for b in args.concurrency:
        n = min(args.num_prompts, args.offline_b1_prompts) if b == 1 else args.num_prompts
        prompts = [s.prompt for s in make_requests(n, input_len=args.input_len, output_len=args.output_len,
                                                   vocab_size=vocab, seed=args.seed)]
        warm = [s.prompt for s in make_requests(b, input_len=args.input_len, output_len=WARMUP_OUTPUT_LEN,
                                                vocab_size=vocab, seed=warmup_seed(args.seed))]
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"ckpt": str(ckpt), "dtype": VLLM_DTYPES[args.dtype], "batch": b, "seed": args.seed,
                    "max_model_len": args.max_model_len, "prompts": prompts, "warmup_prompts": warm,
                    "output_len": args.output_len,
                    "out": str(Path(tmp) / "r.json")}
            env = {**os.environ, **OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": vllm_kv_space(args.kv_gib),
                   "VLLM_CPU_OMP_THREADS_BIND": cores_text(args.compute_cores)}
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as f:
                spec_path = Path(tmp) / "spec.json"  # a file: the prompts of a long run overflow argv
                spec_path.write_text(json.dumps(spec))
                subprocess.run([args.vllm_python, "-c", VLLM_OFFLINE, str(spec_path)], check=True, cwd=tmp,
                               env=env, stdout=f, stderr=subprocess.STDOUT, timeout=CLIENT_TIMEOUT_S,
                               preexec_fn=lambda: os.sched_setaffinity(0, args.compute_cores))
            rows.append(json.loads((Path(tmp) / "r.json").read_text()))
        log(f"vLLM offline LLM.generate at batch {b}: {rows[-1]['out_tok_s']:.1f} out tok/s")
    return {"rows": rows}


def run_worker(kind: str, cores: list[int], threads: int, **kw: Any) -> dict[str, Any]:
    """Runs `kind` (stream | offline) in a fresh process pinned to `cores`; returns its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        spec = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in kw.items()})
        env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, __file__, "--worker", kind, "--worker-spec", spec, "--worker-out", str(out),
                        "--cores", ",".join(map(str, cores)), "--kiln-threads", str(threads)],
                       check=True, cwd=REPO, env=env, timeout=CLIENT_TIMEOUT_S)
        return json.loads(out.read_text())


def _worker_main(args: argparse.Namespace) -> int:
    if args.worker == "offline":
        import kiln.runtime  # noqa: F401  before torch, as in a user's script: the OpenMP policy kiln sets (threads.py)
    _pin(args.cores, args.kiln_threads)
    spec = json.loads(args.worker_spec)
    if args.worker == "stream":
        result = stream_worker(Path(spec["ckpt"]), spec["min_time"], spec.get("dtype", "fp32"))
    else:
        spec["art"] = Path(spec["art"])
        result = offline_worker(**spec)
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


# Servers --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process group: started pinned to the cores, ready within a bound, killed in `stop()`."""

    def __init__(self, kind: str, cmd: list[str], env: dict[str, str], cores: list[int], log_path: Path) -> None:
        self.kind, self.port, self.log_path = kind, int(cmd[cmd.index("--port") + 1]), log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.kind} server not ready in {timeout:.0f} s:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and \
                        httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 15 s; every process of the group is gone after."""
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; children (vLLM's engine core) may linger a moment
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def start_server(kind: str, ckpt: Path, art: Path, args: argparse.Namespace, log_path: Path) -> Server:
    port = free_port()
    env = {**os.environ, **OFFLINE_ENV}
    if kind == "kiln":
        cmd = [sys.executable, "-m", "kiln.cli", "serve", str(art), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, "--log-level", "warning",
               "--num-kv-blocks", str(kiln_kv_blocks(art, args.kv_gib)), *args.kiln_serve_args.split()]
        env["OMP_NUM_THREADS"] = str(args.kiln_threads)
        if args.compute_cores != args.cores:  # the engine core computes on these, the API server on the rest
            cmd += ["--core-cpus", cores_text(args.compute_cores)]
    else:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--host",
               "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME, "--max-model-len",
               str(args.max_model_len), "--dtype", VLLM_DTYPES[args.dtype], "--seed", str(args.seed)]
        env.update(VLLM_CPU_KVCACHE_SPACE=vllm_kv_space(args.kv_gib), VLLM_CPU_OMP_THREADS_BIND=cores_text(args.compute_cores))
    return Server(kind, cmd, env, args.cores, log_path)


def vllm_kv_space(gib: float) -> str:
    """VLLM_CPU_KVCACHE_SPACE: whole GiB (vLLM parses an int), at least 1."""
    return str(max(1, math.ceil(gib)))


def kiln_kv_blocks(art: Path, kv_gib: float) -> int:
    kv = json.loads((art / "manifest.json").read_text())["kv_cache"]
    return int(kv_gib * 2**30) // (kv["block_size"] * kv["bytes_per_token"])


def cores_text(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def parse_cores(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


# Clients --------------------------------------------------------------------------------------------------
def kiln_client(url: str, vocab: int, concurrency: int, args: argparse.Namespace, num_prompts: int | None = None,
                output_len: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """`seed`: the run's prompts (random token ids); default --seed."""
    from kiln.bench import make_requests, run_serve

    n = num_prompts or args.num_prompts
    seed = args.seed if seed is None else seed
    requests = make_requests(n, input_len=args.input_len, output_len=output_len or args.output_len,
                             vocab_size=vocab, seed=seed)
    r = asyncio.run(run_serve(url, model=SERVED_NAME, requests=requests, max_concurrency=concurrency,
                              seed=seed, timeout=CLIENT_TIMEOUT_S))
    return {"out_tok_s": r["output_token_throughput"], "tpot_p50_ms": r["tpot_ms"]["p50"],
            "tpot_mean_ms": r["tpot_ms"]["mean"], "ttft_p50_ms": r["ttft_ms"]["p50"],
            "itl_p50_ms": r["itl_ms"]["p50"], "e2e_p50_ms": r["e2e_ms"]["p50"], "completed": r["completed"],
            "failed": r["failed"], "errors": r["errors"], "output_tokens": r["total_output_tokens"],
            "duration_s": r["duration_s"]}


def vllm_client(url: str, ckpt: Path, concurrency: int, args: argparse.Namespace, log_path: Path,
                seed: int) -> dict[str, Any]:
    """`seed`: the run's prompts (vLLM's random dataset)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [args.vllm_python, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", url, "--model", SERVED_NAME,
               "--tokenizer", str(ckpt), "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed",
               str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result",
               "--result-dir", tmp, "--result-filename", "r.json"]
        with open(log_path, "ab") as f:
            subprocess.run(cmd, check=True, cwd=tmp, env={**os.environ, **OFFLINE_ENV}, stdout=f,
                           stderr=subprocess.STDOUT, timeout=CLIENT_TIMEOUT_S)
        r = json.loads((Path(tmp) / "r.json").read_text())
    return {"out_tok_s": r["output_throughput"], "tpot_p50_ms": r["median_tpot_ms"],
            "tpot_mean_ms": r["mean_tpot_ms"], "ttft_p50_ms": r["median_ttft_ms"], "itl_p50_ms": r["median_itl_ms"],
            "e2e_p50_ms": r.get("median_e2el_ms"), "completed": r["completed"],
            "failed": r.get("failed", args.num_prompts - r["completed"]), "errors": [],
            "output_tokens": r["total_output_tokens"], "input_tokens": r["total_input_tokens"],
            "duration_s": r["duration"]}


# Profile --------------------------------------------------------------------------------------------------
def group_cpu(pgid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of every process in process group `pgid`: {tid: (comm, s)}."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                stat = (task / "stat").read_text()
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                out[int(task.name)] = (f"{proc.name}/{comm}", (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):  # a task that ended while being read
            continue
    return out


def _tree_cpu(root: int) -> float:
    """CPU seconds (user + system) of process `root` and every live descendant (kiln's engine core runs in a
    process group of its own, so a group is not enough)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while being read
            continue
        parent[int(proc.name)] = int(fields[1])
        cpu[int(proc.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree]
        tree.update(kids)
        frontier = kids
    return sum(cpu.get(pid, 0.0) for pid in tree)


def profile_kiln(ckpt_name: str, art: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Where kiln's served time goes at concurrency C: while kiln's client keeps C requests in flight, (1) the
    CPU seconds of every thread of the server's process group and of the client, (2) py-spy samples of the
    server, all threads, idle included (wall clock), then (3) py-spy samples of the thread holding the GIL
    (`--gil`); each aggregated per thread into the top inclusive and self frames."""
    import resource

    py_spy = args.py_spy or shutil.which("py-spy")
    if not py_spy:
        return {"error": "py-spy not found (pip install py-spy; pass --py-spy PATH)"}
    vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
    server = start_server("kiln", art, art, args, logs / f"{ckpt_name}-kiln-profile.log")
    raws = {mode: logs / f"{ckpt_name}-kiln-profile-{mode}.txt" for mode in ("wall", "gil")}
    try:
        server.wait_ready(READY_TIMEOUT_S["kiln"])
        warm_up(server.url, vocab, [args.profile_concurrency], args)
        spy = [py_spy, "record", "--pid", str(server.proc.pid), "--duration", str(args.profile_seconds), "--rate",
               "50", "--format", "raw", "--threads"]
        script = (f"sleep 2; {' '.join(spy)} --idle --output {raws['wall']}; "
                  f"{' '.join(spy)} --gil --output {raws['gil']}")
        before, self_before = group_cpu(server.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        sampler = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)
        try:
            # the load is repeated (new prompts each time: no prefix-cache hits) until both windows are over
            loads = []
            deadline = time.monotonic() + 2 * args.profile_seconds + 120
            while not loads or (sampler.poll() is None and time.monotonic() < deadline):
                loads.append(kiln_client(server.url, vocab, args.profile_concurrency, args,
                                         num_prompts=max(args.num_prompts, 3 * args.profile_concurrency),
                                         seed=args.seed + 500_000 + len(loads)))
            wall = time.monotonic() - t0
            after, self_after = group_cpu(server.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
            err = sampler.communicate(timeout=2 * args.profile_seconds + 60)[1].decode(errors="replace")
        finally:
            if sampler.poll() is None:
                os.killpg(sampler.pid, signal.SIGKILL)
                sampler.wait()
        result: dict[str, Any] = {"concurrency": args.profile_concurrency, "seconds": args.profile_seconds,
                                  "load": loads, "load_wall_s": wall, "load_avg_1m": os.getloadavg()[0]}
        names: dict[int, str] = {}
        for mode, raw in raws.items():
            if not raw.exists():
                result[mode] = {"error": f"py-spy wrote nothing: {err[-500:]}"}
                continue
            result[mode] = summarize_stacks(raw.read_text())
            names.update(result[mode].pop("tids"))
        cores = {}
        for tid, (comm, cpu) in after.items():
            used = cpu - before.get(tid, (comm, 0.0))[1]
            if used > 0.01 * wall:
                cores[f"{comm}/{names.get(tid, tid)}"] = round(used / wall, 3)
        client = (self_after.ru_utime + self_after.ru_stime) - (self_before.ru_utime + self_before.ru_stime)
        cores["client (this process)"] = round(client / wall, 3)
        result["cores_used"] = dict(sorted(cores.items(), key=lambda kv: -kv[1]))
        return result
    finally:
        server.stop()


def _frame(text: str) -> str:
    """'func (path/to/file.py:123)' -> 'file.py:func' (module path kept from the package root)."""
    name, _, where = text.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/kiln/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{name}"


def summarize_stacks(raw: str, top: int = 15) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks -> per thread: share of samples, top inclusive and top self frames
    (shares of that thread's samples); `tids` maps OS thread ids to Python thread names."""
    threads: dict[str, dict[str, Any]] = {}
    tids: dict[int, str] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, frames = frames[0], [_frame(f) for f in frames[1:]]
        head, _, name = thread.partition("): ")  # 'thread (12811): kiln-engine'
        if head.startswith("thread (") and head[8:].isdigit():
            tids[int(head[8:])] = name or head
        t = threads.setdefault(thread, {"samples": 0, "inclusive": collections.Counter(),
                                        "self": collections.Counter()})
        n = int(count)
        t["samples"] += n
        for f in set(frames):
            t["inclusive"][f] += n
        if frames:
            t["self"][frames[-1]] += n
    total = sum(t["samples"] for t in threads.values()) or 1
    out = {}
    for thread, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        n = t["samples"]
        out[thread] = {"samples": n, "share": round(n / total, 4),
                       "inclusive": [[f, round(c / n, 4)] for f, c in t["inclusive"].most_common(top)],
                       "self": [[f, round(c / n, 4)] for f, c in t["self"].most_common(top)]}
    return {"threads": out, "tids": tids}


# The run --------------------------------------------------------------------------------------------------
def warm_up(url: str, vocab: int, concurrency: list[int], args: argparse.Namespace) -> None:
    """One wave of min(C, N) short requests at each concurrency C: the prefill and decode batch shapes the
    measured runs will use have run once (vLLM compiles per shape range; torch warms its allocators)."""
    for c in concurrency:
        kiln_client(url, vocab, c, args, num_prompts=min(c, args.num_prompts), output_len=WARMUP_OUTPUT_LEN,
                    seed=warmup_seed(args.seed))


def serve_rounds(name: str, ckpt: Path, art: Path, args: argparse.Namespace, logs: Path,
                 out: dict[str, Any], save: Any) -> None:
    """Fills `out` = {server: {"startup_s": [...], "clients": {client: {concurrency: [round results]}}}},
    calling `save()` after every client run."""
    vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
    servers = ["kiln"] + (["vllm"] if args.vllm_python and not args.kiln_only else [])
    clients = (["vllm"] if args.vllm_python else []) + ["kiln"]
    out.update({s: {"startup_s": [], "clients": {c: {str(k): [] for k in args.concurrency} for c in clients}}
                for s in servers})
    for rnd in range(args.rounds):
        for kind in (servers if rnd % 2 == 0 else servers[::-1]):
            log(f"{name}: round {rnd + 1}/{args.rounds}: starting {kind}")
            server = start_server(kind, ckpt, art, args, logs / f"{name}-{kind}-r{rnd + 1}.log")
            try:
                out[kind]["startup_s"].append(server.wait_ready(READY_TIMEOUT_S[kind]))
                if kind == "vllm":
                    out[kind]["thread_notes"] = vllm_thread_notes(server.log_tail(200_000))
                warm_up(server.url, vocab, args.concurrency, args)
                for ci, c in enumerate(args.concurrency):
                    order = clients if rnd % 2 == 0 else clients[::-1]
                    for client in order if rnd < args.cross_check_rounds or len(order) == 1 else clients[:1]:
                        load = os.getloadavg()[0]
                        who = resource.RUSAGE_CHILDREN if client == "vllm" else resource.RUSAGE_SELF
                        s0, c0 = _tree_cpu(server.proc.pid), _own_cpu(who)
                        if client == "vllm":
                            r = vllm_client(server.url, ckpt, c, args, logs / f"{name}-vllm-client.log",
                                            seed=run_seed(args.seed, rnd, ci, 0))
                        else:
                            r = kiln_client(server.url, vocab, c, args, seed=run_seed(args.seed, rnd, ci, 1))
                        s1, c1 = _tree_cpu(server.proc.pid), _own_cpu(who)
                        r.update(round=rnd + 1, load_avg_1m=[load, os.getloadavg()[0]],
                                 server_cpu_ms_per_token=(s1 - s0) / max(r["output_tokens"], 1) * 1e3,
                                 client_cpu_ms_per_token=(c1 - c0) / max(r["output_tokens"], 1) * 1e3)
                        out[kind]["clients"][client][str(c)].append(r)
                        save()
                        log(f"{name}: {kind} server, {client} client, concurrency {c}: "
                            f"{r['out_tok_s']:.1f} out tok/s, TPOT p50 {r['tpot_p50_ms']:.1f} ms"
                            + (f", {r['failed']} failed" if r["failed"] else ""))
            finally:
                server.stop()


def vllm_thread_notes(log_text: str) -> list[str]:
    """What vLLM says about its threads (OpenMP binding, torch threads per process) in its log."""
    keys = ("core ids=", "VLLM_CPU_OMP_THREADS_BIND=", "Torch threads", "OMP_NUM_THREADS")
    return [line.strip()[-200:] for line in log_text.splitlines() if any(k in line for k in keys)][:12]


def summarize(result: dict[str, Any], concurrency: list[int]) -> list[dict[str, Any]]:
    """One row per (checkpoint, concurrency): medians over rounds, with every round's figure kept."""
    rows = []
    for name, m in result["checkpoints"].items():
        stream = m["stream"]
        offline = {str(r["batch"]): r for r in m["offline"]["rows"]}
        served = m["served"]
        primary = "vllm" if "vllm" in served["kiln"]["clients"] else "kiln"  # the client the table is read from
        for c in map(str, concurrency):
            row: dict[str, Any] = {"checkpoint": name, "concurrency": int(c), "client": primary}
            for server in served:
                runs = served[server]["clients"][primary][c]
                row[f"{server}_out_tok_s"] = [r["out_tok_s"] for r in runs]
                row[f"{server}_tpot_p50_ms"] = statistics.median(r["tpot_p50_ms"] for r in runs)
                row[f"{server}_ttft_p50_ms"] = statistics.median(r["ttft_p50_ms"] for r in runs)
                row[f"{server}_stream_share"] = stream["pass_ms_best"] / row[f"{server}_tpot_p50_ms"]
                if primary != "kiln" and served[server]["clients"]["kiln"][c]:
                    row[f"{server}_kiln_client_out_tok_s"] = [r["out_tok_s"] for r in served[server]["clients"]["kiln"][c]]
            kiln_med = statistics.median(row["kiln_out_tok_s"])
            if "vllm" in served:
                row["ratio"] = kiln_med / statistics.median(row["vllm_out_tok_s"])
                if "kiln_kiln_client_out_tok_s" in row and "vllm_kiln_client_out_tok_s" in row:
                    row["ratio_kiln_client"] = statistics.median(row["kiln_kiln_client_out_tok_s"]) / \
                        statistics.median(row["vllm_kiln_client_out_tok_s"])
            row["kiln_offline_out_tok_s"] = offline[c]["out_tok_s"]
            row["served_over_offline"] = kiln_med / offline[c]["out_tok_s"]
            if "vllm_offline" in m and "vllm_out_tok_s" in row:
                v_off = {str(r["batch"]): r for r in m["vllm_offline"]["rows"]}[c]["out_tok_s"]
                row["vllm_offline_out_tok_s"] = v_off
                row["vllm_served_over_offline"] = statistics.median(row["vllm_out_tok_s"]) / v_off
            # CPU per output token (ms, every core), read from the runs of kiln's client (in this process, so its
            # CPU is its own; vLLM's client is a fresh process whose start-up would count): offline's, each server's
            # process group's, the client's; and the served / offline a server costing no more than offline would
            # reach beside this client on the same (saturated) cores, offline / (offline + client)
            runs = served["kiln"]["clients"]["kiln"][c]
            if "cpu_ms_per_token" in offline[c] and runs and "client_cpu_ms_per_token" in runs[0]:
                off = offline[c]["cpu_ms_per_token"]
                client = statistics.median(r["client_cpu_ms_per_token"] for r in runs)
                row["cpu_ms_per_token"] = {
                    "offline": off, "client": client,
                    **{f"{srv}_server": statistics.median(r["server_cpu_ms_per_token"]
                                                          for r in served[srv]["clients"]["kiln"][c])
                       for srv in served if served[srv]["clients"]["kiln"][c]}}
                row["kiln_client_served_over_offline"] = statistics.median(r["out_tok_s"] for r in runs) / \
                    offline[c]["out_tok_s"]
                if not result["threads"].get("client_cores"):  # the client shares the servers' cores
                    row["zero_overhead_ceiling"] = off / (off + client)
            rows.append(row)
    return rows


def format_table(result: dict[str, Any]) -> str:
    def toks(xs: list[float]) -> str:
        return " / ".join(f"{x:.0f}" if x >= 100 else f"{x:.1f}" for x in xs)

    vllm = any("vllm_out_tok_s" in r for r in result["summary"])
    head = ["checkpoint", "conc", "kiln out tok/s"] + (["vLLM out tok/s", "ratio"] if vllm else []) + \
        ["kiln TPOT p50"] + (["vLLM TPOT p50"] if vllm else []) + \
        ["kiln offline tok/s", "served/offline", "limit/TPOT kiln"] + (["limit/TPOT vLLM"] if vllm else []) + \
        (["ratio, kiln's client"] if vllm else []) + \
        (["kiln out tok/s, kiln's client"] if any("kiln_kiln_client_out_tok_s" in r for r in result["summary"]) else [])
    t = result.get("threads") or {}
    lines = [f"servers on cores {t.get('cores')}, engines computing on {t.get('compute_cores') or t.get('cores')}, "
             f"clients on {t.get('client_cores') or 'any core'}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["summary"]:
        m = result["checkpoints"][r["checkpoint"]]
        cells = [f"{r['checkpoint']} ({m['params'] / 1e6:.1f} M)", str(r["concurrency"]), toks(r["kiln_out_tok_s"])]
        if vllm:
            cells += [toks(r["vllm_out_tok_s"]), f"{r['ratio']:.2f}×"]
        cells.append(f"{r['kiln_tpot_p50_ms']:.1f} ms")
        if vllm:
            cells.append(f"{r['vllm_tpot_p50_ms']:.1f} ms")
        cells += [f"{r['kiln_offline_out_tok_s']:.0f}", f"{r['served_over_offline']:.2f}×",
                  f"{r['kiln_stream_share']:.0%}"]
        if vllm:
            cells += [f"{r['vllm_stream_share']:.0%}",
                      f"{r['ratio_kiln_client']:.2f}×" if "ratio_kiln_client" in r else "-"]
        if "kiln_kiln_client_out_tok_s" in r:
            cells.append(toks(r["kiln_kiln_client_out_tok_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    cpu_rows = [r for r in result["summary"] if "cpu_ms_per_token" in r]
    if cpu_rows:
        lines += ["", "CPU ms per output token, every core, under kiln's client:", "",
                  "| checkpoint | conc | kiln offline | kiln server | client | served/offline | ceiling "
                  "(a server costing offline's, this client) |" + (" vLLM server | vLLM served/offline |" if vllm else ""),
                  "|" + "---|" * (7 + 2 * vllm)]
        for r in cpu_rows:
            cpu = r["cpu_ms_per_token"]
            cells = [r["checkpoint"], str(r["concurrency"]), f"{cpu['offline']:.3f}", f"{cpu['kiln_server']:.3f}",
                     f"{cpu['client']:.3f}", f"{r['kiln_client_served_over_offline']:.2f}×",
                     f"{r['zero_overhead_ceiling']:.2f}×" if "zero_overhead_ceiling" in r else "- (own cores)"]
            if vllm:
                cells += [f"{cpu.get('vllm_server', float('nan')):.3f}",
                          f"{r['vllm_served_over_offline']:.2f}×" if "vllm_served_over_offline" in r else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, m in result["checkpoints"].items():
        s = m["stream"]
        lines.append(f"{name}: {s['weight_bytes'] / 1e6:.0f} MB of {s.get('dtype', 'fp32')} matrices per decode step; "
                     + ("limit from the fp32 " if s.get("dtype") == "bf16" else "") + "mv loop best "
                     f"{s['pass_ms_best']:.2f} ms ({s['bandwidth_gb_s_best']:.1f} GB/s; median {s['pass_ms_median']:.2f} "
                     f"ms) -> batch-1 decode limit {s['limit_tok_s_batch1']:.0f} tok/s")
    return "\n".join(lines)


def lscpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", help="comma-separated: random, embedded, tiny (default random,embedded; "
                    "--tiny: tiny)")
    ap.add_argument("--tiny", action="store_true", help="smoke mode: tiny model, concurrency 4, 4 prompts of 16 -> 8 "
                    "tokens, one round, short streaming loop, no profile")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed (omit: kiln only)")
    ap.add_argument("--concurrency", help="comma-separated (default 1,16,64)")
    ap.add_argument("--num-prompts", type=int, help="requests per client run (default 48)")
    ap.add_argument("--input-len", type=int, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, help="output tokens (default 64)")
    ap.add_argument("--rounds", type=int, help="rounds, servers alternating (default 2)")
    ap.add_argument("--cross-check-rounds", type=int, help="rounds that also run kiln's client when vLLM's runs "
                    "(default: every round)")
    ap.add_argument("--offline-b1-prompts", type=int, default=8, help="prompts of the offline batch-1 run")
    ap.add_argument("--cores", type=parse_cores, help="cores both servers run on, e.g. 0-1 (default: all allowed)")
    ap.add_argument("--compute-cores", type=parse_cores, help="cores the engines compute on, within --cores: kiln "
                    "`--core-cpus` (its API server on the rest of --cores), vLLM VLLM_CPU_OMP_THREADS_BIND, and "
                    "the offline and streaming workers (default: --cores)")
    ap.add_argument("--client-cores", type=parse_cores, help="cores the clients (kiln's, in this process, and "
                    "vLLM's) run on, e.g. 1 (default: not pinned, they share the servers' cores)")
    ap.add_argument("--kiln-threads", type=int, help="kiln's OMP_NUM_THREADS (default: the number of cores)")
    ap.add_argument("--vllm-offline", action="store_true",
                    help="with --vllm-python: also vLLM's offline LLM.generate at each concurrency (vLLM's "
                         "served/offline beside kiln's)")
    ap.add_argument("--kiln-only", action="store_true",
                    help="with --vllm-python: serve kiln only, measured with vLLM's client and kiln's")
    ap.add_argument("--kiln-serve-args", default="", help="more `kiln serve` options for kiln's server, e.g. "
                    "'--stream-interval 4' (recorded in the JSON)")
    ap.add_argument("--kv-gib", type=float, help="KV cache space of each server, GiB (default 2; --tiny: 1/16)")
    ap.add_argument("--max-model-len", type=int, default=512, help="vLLM's --max-model-len (default 512)")
    ap.add_argument("--stream-seconds", type=float, help="length of the streaming loop (default 3)")
    ap.add_argument("--profile-concurrency", type=int, help="profile kiln's server at this concurrency (default 16, "
                    "0: no profile)")
    ap.add_argument("--profile-seconds", type=int, default=5)
    ap.add_argument("--py-spy", help="py-spy executable (default: py-spy on PATH)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="fp32",
                    help="both servers' dtype (kiln: the recipe's; vLLM: --dtype); default fp32")
    ap.add_argument("--work-dir", type=Path, default=REPO / "build" / "bench" / "peer")
    ap.add_argument("--out-dir", type=Path, help="where the run's JSON goes (default benchmarks/results/DATE-cpu)")
    ap.add_argument("--table", type=Path, help="print the table of a run's JSON and exit")
    ap.add_argument("--worker", choices=["stream", "offline"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-spec", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.cores = args.cores or sorted(os.sched_getaffinity(0))
    args.compute_cores = args.compute_cores or args.cores
    args.kiln_threads = args.kiln_threads or len(args.compute_cores)
    if args.worker:
        return _worker_main(args)
    if args.table:
        result = json.loads(args.table.read_text())
        if result.get("checkpoints"):  # summarized again: a JSON of an earlier version has the measurements
            result["summary"] = summarize(result, result["workload"]["concurrency"])
        print(format_table(result))
        return 0

    smoke = dict(checkpoints="tiny", concurrency="4", num_prompts=4, input_len=16, output_len=8, rounds=1,
                 stream_seconds=0.2, profile_concurrency=0, kv_gib=1 / 16)
    full = dict(checkpoints="random,embedded", concurrency="1,16,64", num_prompts=48, input_len=128, output_len=64,
                rounds=2, stream_seconds=3.0, profile_concurrency=16, kv_gib=2.0)
    for key, value in (smoke if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.checkpoints = args.checkpoints.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.cross_check_rounds is None:
        args.cross_check_rounds = args.rounds
    if args.vllm_python and not Path(args.vllm_python).exists():
        ap.error(f"--vllm-python {args.vllm_python} does not exist")
    unknown = [c for c in args.checkpoints if c not in ("embedded", *MODELS)]
    if unknown:
        ap.error(f"unknown checkpoint(s) {unknown} (known: embedded, {', '.join(MODELS)})")

    if args.client_cores and set(args.client_cores) & set(args.compute_cores):
        ap.error(f"--client-cores {args.client_cores} overlap the compute cores {args.compute_cores}")
    mask = os.sched_getaffinity(0)
    if args.client_cores:  # this process runs kiln's client and starts vLLM's; servers and workers pin themselves
        os.sched_setaffinity(0, args.client_cores)
    try:
        return _run(args, argv)
    finally:
        os.sched_setaffinity(0, mask)  # a caller in this process (a test) gets its cores back


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    now = datetime.now(UTC)
    out_dir = args.out_dir or REPO / "benchmarks" / "results" / f"{now:%Y-%m-%d}-cpu"
    logs = args.work_dir / "logs" / f"{now:%Y%m%dT%H%M%S}"
    result: dict[str, Any] = {
        "date_utc": now.isoformat(timespec="seconds"), "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "host": {"lscpu_model": lscpu_model(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "concurrency", "rounds",
                                                    "seed", "kv_gib", "dtype")},
        "threads": {"cores": args.cores, "compute_cores": args.compute_cores, "client_cores": args.client_cores,
                    "kiln": {"OMP_NUM_THREADS": args.kiln_threads, "affinity": args.cores,
                             "core_cpus": args.compute_cores if args.compute_cores != args.cores else None},
                    "vllm": {"VLLM_CPU_OMP_THREADS_BIND": cores_text(args.compute_cores), "affinity": args.cores}
                    if args.vllm_python else None},
        "vllm_python": args.vllm_python, "kiln_serve_args": args.kiln_serve_args,
        "kiln_only": args.kiln_only, "checkpoints": {},
    }
    t_run = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cpu_peer-{now:%H%M%S}.json"

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        result["duration_s"] = time.monotonic() - t_run
        path.write_text(json.dumps(result, indent=1) + "\n")

    for name in args.checkpoints:
        work = args.work_dir / (name if args.dtype == "fp32" else f"{name}-{args.dtype}")
        ckpt = checkpoint(name, args.work_dir)
        art = compile_for_kiln(ckpt, work, args.dtype)
        m: dict[str, Any] = {"checkpoint": str(ckpt), "artifact": str(art), "params": param_count(ckpt),
                             "kiln_num_kv_blocks": kiln_kv_blocks(art, args.kv_gib), "served": {}}
        result["checkpoints"][name] = m
        log(f"{name}: streaming limit")
        m["stream"] = run_worker("stream", args.compute_cores, args.kiln_threads, ckpt=ckpt, min_time=args.stream_seconds,
                                 dtype=args.dtype)
        log(f"{name}: offline LLM.generate at batch {args.concurrency}")
        m["offline"] = run_worker("offline", args.compute_cores, args.kiln_threads, art=art, batches=args.concurrency,
                                  num_prompts=args.num_prompts, b1_prompts=args.offline_b1_prompts,
                                  input_len=args.input_len, output_len=args.output_len,
                                  num_kv_blocks=m["kiln_num_kv_blocks"], seed=args.seed)
        m["offline"]["load_avg_1m"] = os.getloadavg()[0]
        save()
        if args.vllm_offline:
            log(f"{name}: vLLM offline LLM.generate at batch {args.concurrency}")
            vocab = json.loads((art / "manifest.json").read_text())["runtime"]["vocab_size"]
            m["vllm_offline"] = vllm_offline(ckpt, vocab, args, logs / f"{name}-vllm-offline.log")
            save()
        serve_rounds(name, ckpt, art, args, logs, m["served"], save)
        if args.profile_concurrency:
            log(f"{name}: profiling kiln's server at concurrency {args.profile_concurrency}")
            m["profile"] = profile_kiln(name, art, args, logs)
        save()
    result["host"]["load_avg_end"] = os.getloadavg()
    result["summary"] = summarize(result, args.concurrency)
    save()
    print(format_table(result))
    log(f"wrote {path} (server logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
