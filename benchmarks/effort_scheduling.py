"""Short requests behind long-budget ones: time to first token and end-to-end latency of each class under the
`fcfs` and `effort` scheduler policies (scheduler.py), on the embedded model.

The workload: `--long` requests with a budget of `--long-tokens` (think of high reasoning effort) arrive first,
then `--short` requests of `--short-tokens` each, all at once; `--max-seqs` sequences run at a time, so the
queue decides who waits. Every request ignores EOS, so both policies do the same work; latencies are measured
from the common arrival, per request, in LLMEngine.step() wall time.

    python benchmarks/effort_scheduling.py --torch-threads 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import ensure_artifact  # noqa: E402


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run(artifact: Path, policy: str, args: argparse.Namespace) -> dict:
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    engine = LLMEngine(artifact, policy=policy, max_num_seqs=args.max_seqs)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}]),
                        add_special_tokens=False)
    requests = [(f"long-{i}", args.long_tokens) for i in range(args.long)] + \
        [(f"short-{i}", args.short_tokens) for i in range(args.short)]
    start = time.perf_counter()
    for request_id, n in requests:
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
    result = {"policy": policy}
    for kind in ("short", "long"):
        ids = [r for r, _ in requests if r.startswith(kind)]
        ttft = [first[r] * 1e3 for r in ids]
        e2e = [done[r] * 1e3 for r in ids]
        result[kind] = {"ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": _p(ttft, 0.99),
                        "e2e_p50_ms": statistics.median(e2e), "e2e_p99_ms": _p(e2e, 0.99)}
    result["makespan_ms"] = max(done.values()) * 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default="auto", choices=["auto", "embedded", "tiny"])
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    name, artifact = ensure_artifact(args.artifact)
    print(json.dumps({"artifact": name, **{k: v for k, v in vars(args).items() if k != "artifact"}}))
    for policy in ("fcfs", "effort"):
        print(json.dumps(run(artifact, policy, args)))


if __name__ == "__main__":
    main()
