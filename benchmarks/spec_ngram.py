"""Decode speed and acceptance of n-gram (prompt lookup) speculative decoding, on vs off, in-process on this CPU.

The workload repeats its context, as code edits, summaries that quote their source and chat transcripts do:
each prompt is a two-turn chat transcript in the embedded model's own format that stops inside the third
turn, and the model goes on writing turns in the format the prompt repeats. Every request decodes `--max-tokens` greedy tokens (ignore_eos). For each
batch size, modes alternate (off, ngram, off, ngram, ...) `--repeats` times on fresh engines so that a noisy
machine hits both alike; the median tokens/s of each is reported with the ngram run's acceptance.

    python benchmarks/spec_ngram.py --batch-sizes 1 16 --tokens 4 --max-tokens 96 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import ensure_artifact  # noqa: E402

FORTUNES = [
    "Life is a whim of several billion cells to be you for a while.",
    "The meek shall inherit the earth; the rest of us, the Universe.",
    "Experience is what causes a person to make new mistakes instead of old ones.",
    "How long a minute is depends on which side of the bathroom door you're on.",
    "I came to MIT to get an education for myself and a diploma for my mother.",
    "All a man needs out of life is a place to sit 'n' spit in the fire.",
    "The Martian Canals were clearly the Martian's last ditch effort!",
    "A good friend is someone who tells you the truth, even when you do not want to hear it.",
    "The best way to learn a new language is to speak it every day with people who know it well.",
]


TURN = "<|im_start|>user\nSay something wise.<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat transcripts of two turns (rotating fortunes) that stop inside the third turn's question."""
    return [tokenizer.encode("".join(TURN.format(FORTUNES[(i + j) % len(FORTUNES)]) for j in range(2))
                             + "<|im_start|>user\nSay something") for i in range(n)]


def run_once(artifact: Path, batch: list[list[int]], speculative: str | None, k: int, max_tokens: int,
             **engine_kw) -> dict:
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    engine = LLMEngine(artifact, speculative=speculative, num_speculative_tokens=k if speculative else None,
                       prefix_cache=None, **engine_kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("warmup", batch[0][:16], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    base = dict(engine.stats())
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    generated, steps = 0, 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    s = engine.stats()
    drafted = s["spec_num_draft_tokens"] - base["spec_num_draft_tokens"]
    accepted = s["spec_num_accepted_tokens"] - base["spec_num_accepted_tokens"]
    drafts = s["spec_num_drafts"] - base["spec_num_drafts"]
    return {"tokens_per_s": generated / seconds, "cpu_ms_per_token": 1e3 * cpu / generated, "steps": steps,
            "generated": generated,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default="auto", help="auto | embedded | tiny (benchmarks/_artifacts.py)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=4, help="draft tokens a step (speculative.tokens)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    import torch
    from kiln.runtime.artifact import load_artifact

    name, artifact = ensure_artifact(args.artifact)
    tokenizer = load_artifact(artifact).tokenizer
    results = []
    for b in args.batch_sizes:
        batch = prompts(tokenizer, b)
        runs: dict[str, list[dict]] = {"off": [], "ngram": []}
        for _ in range(args.repeats):
            for mode in ("off", "ngram"):
                runs[mode].append(run_once(artifact, batch, None if mode == "off" else "ngram", args.tokens,
                                           args.max_tokens))
        off = statistics.median(r["tokens_per_s"] for r in runs["off"])
        on = statistics.median(r["tokens_per_s"] for r in runs["ngram"])
        last = runs["ngram"][-1]
        results.append({"batch": b, "off_tokens_per_s": off, "ngram_tokens_per_s": on, "speedup": on / off,
                        "acceptance_rate": last["acceptance_rate"],
                        "mean_acceptance_length": last["mean_acceptance_length"],
                        "steps_off": runs["off"][-1]["steps"], "steps_ngram": last["steps"]})
    meta = {"artifact": name, "k": args.tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}))
        return
    print(f"artifact {name}, k = {args.tokens}, {args.max_tokens} greedy tokens a request, "
          f"median of {args.repeats}, {meta['threads']} threads")
    print("batch  off tok/s  ngram tok/s  speed-up  acceptance  mean accepted length  steps off/ngram")
    for r in results:
        print(f"{r['batch']:5d}  {r['off_tokens_per_s']:9.1f}  {r['ngram_tokens_per_s']:11.1f}  {r['speedup']:7.2f}x"
              f"  {r['acceptance_rate']:10.2f}  {r['mean_acceptance_length']:20.2f}  {r['steps_off']}/{r['steps_ngram']}")


if __name__ == "__main__":
    main()
