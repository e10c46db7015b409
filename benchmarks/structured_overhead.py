"""What constrained decoding costs per decode step, at 1, 16 and 64 running sequences, all constrained vs none.

Two measurements on the embedded model's vocabulary (4,096 tokens) and a nested json_schema (objects, arrays,
enums, bounded strings):

* `processor`: the StructuredOutputProcessor alone, as the sampler calls it each step — feed each sequence the
  token it gained, fill the shared bitmask for all rows in one BatchGrammarMatcher call, apply it to the
  logits rows. Each step appends, per row, the highest random logit the mask allows, so the matchers walk
  through real grammar states (a row whose grammar ends restarts). "none" is the same call with no
  constrained request registered (what every unconstrained step pays).
* `engine`: LLMEngine.step() on the embedded model, decoding B sequences for `--steps` steps after their
  prefill, with every request constrained vs none (the processor installed either way; unconstrained
  requests ignore EOS so the batch stays full).

    python benchmarks/structured_overhead.py --torch-threads 1 --repeats 3

Medians of `--repeats` rounds, alternating the modes so a shared machine's load hits both alike.
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
from _artifacts import REPO, ensure_artifact  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
}


class _Seq:
    """The fields of runtime.sequence.Sequence the processor reads."""

    __slots__ = ("seq_id", "request_id", "index", "token_ids", "num_prompt_tokens")

    def __init__(self, k: int) -> None:
        self.seq_id, self.request_id, self.index, self.token_ids, self.num_prompt_tokens = k, f"r{k}", 0, [0], 1


def processor_round(backend, compiled, batch: int, steps: int, constrained: bool) -> float:
    """Mean seconds per processor call over `steps` steps."""
    from kiln.runtime.core.structured_output import StructuredOutputProcessor

    vocab = backend.vocab_size
    proc = StructuredOutputProcessor(backend, vocab, max_rows=batch)
    seqs = [_Seq(k) for k in range(batch)]
    if constrained:
        for s in seqs:
            proc.add_request(s.request_id, grammar=compiled)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(64, batch, vocab, generator=gen)
    eos = set(backend.stop_token_ids)
    total = 0.0
    for step in range(steps):
        logits = noise[step % 64].clone()
        t0 = time.perf_counter()
        proc(logits, seqs)
        total += time.perf_counter() - t0
        picks = logits.argmax(dim=-1).tolist()
        for s, t in zip(seqs, picks):
            if constrained and t in eos:  # the grammar ended: start this row's request over
                proc.remove_request(s.request_id)
                proc.add_request(s.request_id, grammar=compiled)
                s.token_ids = [0]
            else:
                s.token_ids.append(t)
    return total / steps


def engine_round(artifact: Path, backend, compiled, batch: int, steps: int, constrained: bool) -> float:
    """Mean seconds per LLMEngine.step() over `steps` decode steps of a full batch."""
    from kiln.runtime.core.structured_output import StructuredOutputProcessor
    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    engine = LLMEngine(artifact, max_num_seqs=max(batch, 1), prefix_cache=None)
    proc = StructuredOutputProcessor(backend, engine.model_config.vocab_size, max_rows=batch)
    engine.sampler.logits_processor = proc
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}]),
                        add_special_tokens=False)
    for k in range(batch):
        if constrained:
            proc.add_request(f"r{k}", grammar=compiled)
        engine.add_request(f"r{k}", prompt, SamplingParams(temperature=1.0, seed=k, max_tokens=steps + 8,
                                                            ignore_eos=not constrained))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        if len(engine.scheduler.running) < batch:  # a constrained request finished early: stop measuring
            break
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for k in range(batch):
        engine.abort_request(f"r{k}")
    engine.drain_aborted()
    return statistics.fmean(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--skip-engine", action="store_true", help="only the processor measurement")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    from kiln.runtime.core.structured_output import GrammarBackend, GrammarSpec, eos_token_ids
    from kiln.runtime.tokenizer import Tokenizer

    name, artifact = ensure_artifact("embedded")
    tok = Tokenizer.from_dir(REPO / "examples" / "embedded")
    manifest = json.loads((artifact / "manifest.json").read_text())
    vocab = int(manifest["runtime"]["vocab_size"]) if "vocab_size" in manifest.get("runtime", {}) else 4096
    backend = GrammarBackend(tok, vocab, eos_token_ids([1, 4], tok), max_whitespace=2)
    t0 = time.perf_counter()
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"model": name, "vocab": vocab, "compile_ms": compile_ms, "torch_threads": torch.get_num_threads(),
                     "processor": {}, "engine": {}}
    for b in batches:
        rounds = {True: [], False: []}
        for _ in range(args.repeats):
            for mode in (False, True):
                rounds[mode].append(processor_round(backend, compiled, b, args.steps * 4, mode))
        results["processor"][b] = {m: statistics.median(r) * 1e6 for m, r in
                                   (("none_us", rounds[False]), ("all_us", rounds[True]))}
        if not args.skip_engine:
            rounds = {True: [], False: []}
            for _ in range(args.repeats):
                for mode in (False, True):
                    rounds[mode].append(engine_round(artifact, backend, compiled, b, args.steps, mode))
            results["engine"][b] = {m: statistics.median(r) * 1e3 for m, r in
                                    (("none_ms", rounds[False]), ("all_ms", rounds[True]))}
    backend.close()

    print(f"{name} (vocab {vocab}), json_schema compile {compile_ms:.1f} ms, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} | {'processor none':>14} | {'processor all':>13} | {'engine step none':>16} | "
          f"{'engine step all':>15} | {'overhead':>8}")
    for b in batches:
        p = results["processor"][b]
        e = results["engine"].get(b)
        line = f"{b:>5} | {p['none_us']:>11.1f} µs | {p['all_us']:>10.1f} µs"
        if e:
            line += (f" | {e['none_ms']:>13.2f} ms | {e['all_ms']:>12.2f} ms | "
                     f"{(e['all_ms'] / e['none_ms'] - 1) * 100:>+7.1f}%")
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
