"""The `kiln` command: compile recipes, generate recipes from checkpoints, run compiled artifacts."""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

USER_ERROR_EXIT = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input, printed without a traceback (exit 2): one root, kiln.errors.KilnError
    (a leaf module, so `kiln serve` does not load the compiler)."""
    from kiln.errors import KilnError

    return (KilnError,)


def _format(err: BaseException) -> str:
    fmt = getattr(err, "format", None)
    return fmt() if callable(fmt) else f"error: {err}"


@contextlib.contextmanager
def _source_warnings() -> Iterator[None]:
    """Prints the compile's located warnings as `file:line:col: warning: ...` with the source line (also when
    the compile then fails); other warnings are shown as Python shows them."""
    from kiln.dsl.errors import SourceWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SourceWarning)
        try:
            yield
        finally:
            for w in caught:
                if isinstance(w.message, SourceWarning):
                    print(w.message.format(), file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


# ---------------------------------------------------------------- commands


def cmd_compile(args: argparse.Namespace) -> int:
    from kiln.driver import compile as compile_recipe

    if args.output is None and not args.report:
        args.report = True  # nothing to write: planning only
    with _source_warnings():
        result = compile_recipe(args.recipe, args.output, target=args.target, recipe_name=args.recipe_name,
                                dump_ir=args.dump_ir, progress=not args.no_progress)
    if args.report:
        sys.stdout.write(result.report)
    if result.artifact_dir is not None:
        print(f"wrote {result.artifact_dir} ({len(result.manifest['kernels'])} kernels, "
              f"{result.manifest['weights']['total_bytes'] / 1e6:,.1f} MB of weights)", file=sys.stderr)
    return 0


def cmd_recipe_from_hf(args: argparse.Namespace) -> int:
    from kiln.recipe_from_hf import recipe_from_hf

    text = recipe_from_hf(args.checkpoint, target=args.target, out_file=args.output, dtype=args.dtype,
                          name=args.name, mtp=not args.no_mtp)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _sampling(args: argparse.Namespace) -> Any:
    from kiln.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)


def _token_ids(text: str) -> list[int]:
    """`--token-ids` prompts: integers separated by spaces or commas."""
    from kiln.runtime.errors import RequestError

    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise RequestError(f"--token-ids: the prompt must be token ids separated by spaces or commas, got {text!r:.60}")
    return [int(p) for p in parts]


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.runtime.errors import RequestError
    from kiln.runtime.llm import LLM

    llm = LLM(str(args.artifact))
    tokenizer = llm.get_tokenizer()
    if tokenizer is None and not args.token_ids:
        raise RequestError(f"{args.artifact} has no tokenizer (compiled with random weights and no `tokenizer = "
                           "\"hf:DIR\"`); give the prompt as token ids: --token-ids \"1 2 3\"")
    params = _sampling(args)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outs = llm.generate([_token_ids(args.prompt) if args.token_ids else args.prompt], params)
    for out in outs:
        completion = out.outputs[0]
        if args.token_ids:
            sys.stdout.write(" ".join(map(str, completion.token_ids)))
        else:
            sys.stdout.write(completion.text if args.chat else args.prompt + completion.text)
        sys.stdout.write("\n")
    return 0


def serve_address(artifact: str, host: str | None, port: int | None) -> tuple[str, int]:
    """The flags, else the manifest's `serve` host and port (the recipe's, else the compiler's defaults)."""
    from kiln.runtime.artifact import read_manifest

    serve = read_manifest(artifact)["serve"]
    return host or serve["host"], port or serve["port"]


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.runtime.server import serve

    host, port = serve_address(args.artifact, args.host, args.port)
    status = serve(args.artifact, host=host, port=port, api_key=args.api_key, metrics_public=args.metrics_public,
                   served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                   num_kv_blocks=args.num_kv_blocks, log_level=args.log_level, prefix_cache=not args.no_prefix_cache,
                   speculative=args.speculative, async_scheduling=args.async_scheduling)
    return status or 0  # 1: the model's executor failed (a parallel artifact's rank died or hung)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (an integer in 1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: a port is an integer in 1..65535")
    return port


def cmd_eval(args: argparse.Namespace) -> int:
    from kiln.eval import eval_compare, eval_ppl

    kw = {"max_tokens": args.max_tokens, "stride": args.stride, "limit": args.limit,
          "progress": False if args.no_progress else None}
    if args.eval_command == "ppl":
        r = eval_ppl(args.artifact, args.text, **kw)
        print(f"{args.artifact}: perplexity {r.ppl:.4f} (nll {r.nll:.5f} nats/token over {r.tokens} tokens)")
        return 0
    c = eval_compare(args.a, args.b, args.text, **kw)
    print(f"A {args.a}: perplexity {c.a.ppl:.4f}\nB {args.b}: perplexity {c.b.ppl:.4f}\n"
          f"KL(A || B) mean {c.kl:.6f} nats/token, max {c.max_kl:.5f}; top-1 agreement {c.top1_agreement:.4f} "
          f"over {c.a.tokens} tokens")
    return 0


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, help="UTF-8 text file to score (tokenized with the artifact's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--stride", type=int, help="window start every S tokens (default: max-tokens / 2)")
    p.add_argument("--limit", type=int, help="score only the first N tokens of the text (default: all of it)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar while scoring (default: one on a terminal, for long texts)")
    p.set_defaults(func=cmd_eval)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to bind (default: the recipe's serve.host, else 127.0.0.1: loopback "
                   "only)")
    p.add_argument("--port", type=_port, help="TCP port, 1..65535 (default: the recipe's serve.port, else 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the /v1 routes and /metrics; /health "
                   "stays open (default: no key, every route open)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper on a trusted network)")
    p.add_argument("--served-model-name", help="model name of the API (default: the recipe's serve.served_name, "
                   "else the artifact directory name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences (prompts x n) waiting before the server answers 503; a request of more is a 400 "
                   "(default 1024)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks (default: the manifest's decision, "
                   "as `kiln compile --report` states it)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the artifact's prefix cache off")
    p.add_argument("--speculative", choices=["mtp", "none"],
                   help="speculative decoding with the artifact's MTP draft head, or none (default: the recipe's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous one's tokens are read back, overlapping "
                   "host work with the device (default: the recipe's, else on for CUDA, off for CPU)")
    p.set_defaults(func=cmd_serve)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (with --token-ids: token ids)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens (default -1: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, not reproducible)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    form.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids separated by spaces or commas, and the completion is printed as "
                   "token ids (what an artifact without a tokenizer takes)")
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: compile LLM recipes into serving artifacts")
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile a recipe into a serving artifact")
    p.add_argument("recipe", help="the recipe file (.dsl)")
    p.add_argument("-o", "--output", help="artifact directory to write (default: none, plan only and print the "
                   "report)")
    p.add_argument("--target", help="compile for this target instead of the recipe's: cpu, h100, h200 (default: "
                   "the recipe's target, else cpu)")
    p.add_argument("--recipe-name", help="which recipe, when the file declares several (default: its only one)")
    p.add_argument("--dump-ir", help="write the IR after every pass into this directory (default: not written)")
    p.add_argument("--report", action="store_true", help="print passes, kernel costs and the capacity plan "
                   "(on by default without -o)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while weights are converted")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("recipe", help="recipe tools")
    rsub = p.add_subparsers(dest="recipe_command", required=True)
    r = rsub.add_parser("from-hf", help="write a recipe for a Hugging Face checkpoint directory")
    r.add_argument("checkpoint", help="a Hugging Face checkpoint directory (config.json, *.safetensors)")
    r.add_argument("--target", default="cpu", help="the recipe's target: cpu, h100, h200 (default cpu)")
    r.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="the recipe's dtype (default: fp32 for cpu, bf16 for GPU targets)")
    r.add_argument("--name", help="recipe name (default: from the directory name)")
    r.add_argument("-o", "--output", help="recipe file to write (default: stdout)")
    r.add_argument("--no-mtp", action="store_true",
                   help="leave out a DeepSeek-V3 multi-token-prediction head (num_nextn_predict_layers)")
    r.set_defaults(func=cmd_recipe_from_hf)

    p = sub.add_parser("generate", help="generate text with a compiled artifact")
    p.add_argument("artifact", help="a compiled artifact directory")
    _add_generate_args(p)

    p = sub.add_parser("serve", help="serve a compiled artifact over an OpenAI-compatible HTTP API")
    p.add_argument("artifact", help="a compiled artifact directory")
    _add_serve_args(p)

    p = sub.add_parser("eval", help="quality checks: perplexity, and KL divergence between two artifacts")
    esub = p.add_subparsers(dest="eval_command", required=True)
    e = esub.add_parser("ppl", help="sliding-window perplexity of an artifact on a text")
    e.add_argument("artifact", help="a compiled artifact directory")
    _add_eval_args(e)
    e = esub.add_parser("compare", help="perplexities of A and B and mean KL(A || B) of their next-token distributions")
    e.add_argument("a", help="reference artifact (e.g. unquantized)")
    e.add_argument("b", help="artifact to compare (e.g. quantized)")
    _add_eval_args(e)

    from kiln.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as e:
        print(_format(e), file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        return 130


def artifact_main(artifact_dir: str, argv: list[str]) -> int:
    """Entry of a compiled artifact's `__main__.py`: `python ART generate "prompt"` or `python ART serve`."""
    if not argv or argv[0] not in ("generate", "serve"):
        print("usage: python ARTIFACT generate \"prompt\" [--max-tokens N] [--temperature T] [--seed S]\n"
              "       python ARTIFACT serve [--host H] [--port P] [--api-key K] [--served-model-name N]",
              file=sys.stderr)
        return USER_ERROR_EXIT
    return main([argv[0], artifact_dir, *argv[1:]])


def _version() -> str:
    from kiln import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
