"""The `kiln` command: compile recipes, generate recipes from checkpoints, run compiled artifacts."""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from kiln.runtime.entrypoint import USER_ERROR_EXIT


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


def cmd_keys(args: argparse.Namespace) -> int:
    from kiln.runtime.ipc.curve import generate

    written = generate(args.directory, force=args.force)
    print("\n".join(f"wrote {path}" for path in written))
    print(f"copy {args.directory} to every machine of the deployment (keep it private: the *_secret files are "
          f"mode 0600) and give --curve-keys {args.directory} to each `kiln serve --role ...` and `kiln router`",
          file=sys.stderr)
    return 0


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, help="UTF-8 text file to score (tokenized with the artifact's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--stride", type=int, help="window start every S tokens (default: max-tokens / 2)")
    p.add_argument("--limit", type=int, help="score only the first N tokens of the text (default: all of it)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar while scoring (default: one on a terminal, for long texts)")
    p.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    from kiln.runtime.entrypoint import add_generate_args, add_serve_args  # the runtime's own commands

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
                   help="the recipe's dtype (default: bf16 for GPU targets; for cpu the checkpoint's when it is bf16, else fp32)")
    r.add_argument("--name", help="recipe name (default: from the directory name)")
    r.add_argument("-o", "--output", help="recipe file to write (default: stdout)")
    r.add_argument("--no-mtp", action="store_true",
                   help="leave out a DeepSeek-V3 multi-token-prediction head (num_nextn_predict_layers)")
    r.set_defaults(func=cmd_recipe_from_hf)

    p = sub.add_parser("generate", help="generate text with a compiled artifact")
    p.add_argument("artifact", help="a compiled artifact directory")
    add_generate_args(p)

    p = sub.add_parser("serve", help="serve a compiled artifact over an OpenAI-compatible HTTP API")
    p.add_argument("artifact", help="a compiled artifact directory")
    add_serve_args(p)

    p = sub.add_parser("eval", help="quality checks: perplexity, and KL divergence between two artifacts")
    esub = p.add_subparsers(dest="eval_command", required=True)
    e = esub.add_parser("ppl", help="sliding-window perplexity of an artifact on a text")
    e.add_argument("artifact", help="a compiled artifact directory")
    _add_eval_args(e)
    e = esub.add_parser("compare", help="perplexities of A and B and mean KL(A || B) of their next-token distributions")
    e.add_argument("a", help="reference artifact (e.g. unquantized)")
    e.add_argument("b", help="artifact to compare (e.g. quantized)")
    _add_eval_args(e)

    p = sub.add_parser("keys", help="CURVE keys that authenticate and encrypt the engine cores' and router's sockets")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    k = ksub.add_parser("generate", help="write a key directory: server and client keypairs and the authorized "
                        "client keys (secret files mode 0600)")
    k.add_argument("directory", help="the directory to write (created, mode 0700)")
    k.add_argument("--force", action="store_true", help="replace the keys already there (default: refuse)")
    k.set_defaults(func=cmd_keys)

    from kiln.runtime.disagg.remote import add_router_args

    add_router_args(sub)

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
    """The entry point of artifacts compiled before it moved to the runtime (kiln.runtime.entrypoint)."""
    from kiln.runtime.entrypoint import artifact_main as runtime_artifact_main

    return runtime_artifact_main(artifact_dir, argv)


def _version() -> str:
    from kiln import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
