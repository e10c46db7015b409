"""Decode speed of EAGLE speculative decoding, on vs off, in-process on this CPU (spec_ngram.py's workload).

The head is random in SafeAILab's EAGLE-1/2 layout, made for the artifact's checkpoint (build/bench/eagle-*/):
`fc` passes the target's feature through (plus noise) and the decoder layer adds a small random term, so its
drafts are about the target's own next token again (accepted where the model repeats itself). What it measures
is the proposer's cost per step next to the target's, at each batch size. `--compare FILE` also runs the
proposer of another version of runtime/core/speculative/eagle.py (`git show REV:runtime/core/speculative/eagle.py >
FILE`), alternating with the current one (off, eagle, compared, off, ...), `--repeats` times on fresh engines.
Reported: the median tokens/s (wall time) and CPU ms a token (this process's CPU time: steadier than wall time
on a shared machine, but it counts threads that spin as well as those that work).

    python benchmarks/spec_eagle.py --batch-sizes 1 8 --tokens 4 --max-tokens 64 --repeats 3 [--compare old.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _artifacts import BUILD, EMBEDDED_CKPT, ensure_artifact  # noqa: E402
from spec_ngram import prompts, run_once  # noqa: E402


def make_head(ckpt: Path, out: Path, seed: int = 0) -> Path:
    """A random EAGLE-1/2 head for the Llama checkpoint `ckpt` (config.json + model.safetensors in `out`)."""
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((ckpt / "config.json").read_text())
    h, f, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kvh, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": torch.cat([rand(h, h), torch.eye(h) + rand(h, h)], 1), "fc.bias": rand(h),
         "layers.0.self_attn.q_proj.weight": rand(heads * d, h), "layers.0.self_attn.k_proj.weight": rand(kvh * d, h),
         "layers.0.self_attn.v_proj.weight": rand(kvh * d, h), "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
         "layers.0.mlp.gate_proj.weight": rand(f, h), "layers.0.mlp.up_proj.weight": rand(f, h),
         "layers.0.mlp.down_proj.weight": rand(h, f), "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "vocab_size", "max_position_embeddings")
    (out / "config.json").write_text(json.dumps({**{k: cfg[k] for k in keep if k in cfg}, "rope_theta": theta,
                                                 "num_hidden_layers": 1, "hidden_act": "silu",
                                                 "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return out


def use_proposer(file: Path | None) -> None:
    """Runs method eagle with the EagleProposer of `file` (None: the current one) from now on."""
    from kiln.runtime.core import speculative

    if file is None:
        speculative.PROPOSERS["eagle"] = "eagle:EagleProposer"
        return
    name = "kiln.runtime.core.speculative.eagle_compared"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    speculative.PROPOSERS["eagle"] = "eagle_compared:EagleProposer"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default="auto", help="auto | embedded | tiny (benchmarks/_artifacts.py)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=4, help="draft tokens a step (speculative.tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another version of runtime/core/speculative/eagle.py, run alternately")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    # before torch: importing kiln.runtime first sets OMP_WAIT_POLICY (runtime/threads.py)
    from kiln.runtime.artifact import load_artifact

    name, artifact = ensure_artifact(args.artifact)
    head = make_head(EMBEDDED_CKPT if name == "embedded" else BUILD / "tiny-ckpt", BUILD / f"eagle-{name}")
    tokenizer = load_artifact(artifact).tokenizer
    modes = ["off", "eagle"] + (["compared"] if args.compare else [])
    results = []
    for b in args.batch_sizes:
        batch = prompts(tokenizer, b)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes:
                use_proposer(args.compare if mode == "compared" else None)
                runs[mode].append(run_once(artifact, batch, None if mode == "off" else "eagle", args.tokens,
                                           args.max_tokens, speculative_model=str(head)))
        row = {"batch": b, **{f"{m}_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[m])
                              for m in modes},
               **{f"{m}_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in runs[m]) for m in modes},
               "acceptance_rate": runs["eagle"][-1]["acceptance_rate"],
               "mean_acceptance_length": runs["eagle"][-1]["mean_acceptance_length"],
               "steps": {m: runs[m][-1]["steps"] for m in modes}}
        if args.compare:
            assert runs["compared"][-1]["steps"] == runs["eagle"][-1]["steps"], "the two proposers drafted differently"
        results.append(row)
    import torch

    meta = {"artifact": name, "k": args.tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "compare": str(args.compare) if args.compare else None}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}))
        return
    print(f"artifact {name}, k = {args.tokens}, {args.max_tokens} greedy tokens a request, "
          f"median of {args.repeats}, {meta['threads']} threads")
    print("batch  " + "  ".join(f"{m + ' tok/s':>15}" for m in modes) + "  "
          + "  ".join(f"{m + ' cpu ms/tok':>20}" for m in modes) + "  acceptance  mean accepted length  steps")
    for r in results:
        print(f"{r['batch']:5d}  " + "  ".join(f"{r[m + '_tokens_per_s']:15.1f}" for m in modes) + "  "
              + "  ".join(f"{r[m + '_cpu_ms_per_token']:20.2f}" for m in modes)
              + f"  {r['acceptance_rate']:10.2f}  {r['mean_acceptance_length']:20.2f}  {r['steps']}")


if __name__ == "__main__":
    main()
