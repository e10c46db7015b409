"""The runtime's commands: `serve` and `generate`, for `kiln serve|generate ART` and for an artifact's own entry
point (`python ARTIFACT serve|generate`, `artifact_main`). Nothing here imports the compiler: a serving image
needs only the runtime's dependencies (requirements-runtime.txt)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

USER_ERROR_EXIT = 2


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(/metrics included, unless --metrics-public)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--served-model-name", help="model name of the API (default: the recipe's serve.served_name, "
                   "else the artifact directory name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences (prompts x n) waiting before the server answers 503; a request of more is a 400 "
                   "(default 1024)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks (default: from the manifest)")
    p.add_argument("--num-threads", type=int, help="the engine core's intra-op threads (default: every CPU the "
                   "process may run on; the API server itself uses one)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the artifact's prefix cache off")
    p.add_argument("--speculative", choices=["mtp", "none"],
                   help="speculative decoding with the artifact's MTP draft head, or none (default: the recipe's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous one's tokens are read back, overlapping "
                   "host work with the device (default: the recipe's, else on for CUDA, off for CPU)")
    p.add_argument("--tool-parser", help="how the model writes tool calls: hermes, llama3_json, mistral, "
                   "deepseek_v3, ... or none (default: what the chat template implies)")
    p.add_argument("--reasoning-parser", help="the model's thinking block: think (<think>), mistral ([THINK]) or none "
                   "(default: what the chat template implies)")
    p.set_defaults(func=run_serve)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(func=run_generate)


def run_serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(args.artifact, host=args.host, port=args.port, api_key=args.api_key,
                 served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                 num_kv_blocks=args.num_kv_blocks, log_level=args.log_level, prefix_cache=not args.no_prefix_cache,
                 speculative=args.speculative, async_scheduling=args.async_scheduling,
                 metrics_public=args.metrics_public, num_threads=args.num_threads, tool_parser=args.tool_parser,
                 reasoning_parser=args.reasoning_parser)


def run_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(str(args.artifact))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outs = llm.generate([args.prompt], params)
    for out in outs:
        text = out.outputs[0].text
        sys.stdout.write(text if args.chat else args.prompt + text)
        sys.stdout.write("\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs a parsed command; a `KilnRuntimeError` is printed without a traceback (exit 2)."""
    from .errors import KilnRuntimeError

    try:
        return args.func(args)
    except KilnRuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        return 130


def artifact_main(artifact_dir: str, argv: list[str]) -> int:
    """Entry of a compiled artifact's `__main__.py`: `python ART generate "prompt"` or `python ART serve`."""
    parser = argparse.ArgumentParser(prog=f"python {artifact_dir}", description="run this kiln artifact")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub.add_parser("generate", help="generate text"))
    add_serve_args(sub.add_parser("serve", help="serve over an OpenAI-compatible HTTP API"))
    args: Any = parser.parse_args(argv)
    args.artifact = artifact_dir
    return run(args)
