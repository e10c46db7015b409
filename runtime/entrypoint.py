"""The runtime's commands: `serve` and `generate`, for `kiln serve|generate ART` and for an artifact's own entry
point (`python ARTIFACT serve|generate`, `artifact_main`). Nothing here imports the compiler: a serving image
needs only the runtime's dependencies (requirements-runtime.txt)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .cli_args import add_security_args, byte_size, cpu_list, effort_table, port_number, positive_int

USER_ERROR_EXIT = 2


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to bind (default: the recipe's serve.host, else 127.0.0.1: loopback "
                   "only)")
    p.add_argument("--port", type=port_number, help="TCP port, 1..65535 (default: the recipe's serve.port, else 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the /v1 routes and /metrics; /health "
                   "stays open (default: no key, every route open)")
    p.add_argument("--enable-lora-loading", action="store_true",
                   help="let clients load LoRA adapters at run time (POST /v1/load_lora_adapter), from --lora-roots "
                   "only (default: off, the endpoint answers 403)")
    p.add_argument("--lora-roots", metavar="DIR[,DIR]", help="with --enable-lora-loading: the directories run-time "
                   "adapters may be read from (symlinks resolved; nothing outside them is read; default: none)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper on a trusted network)")
    p.add_argument("--require-cache-salt", action="store_true",
                   help="refuse (400) completion, chat and response requests without a cache_salt (multi-tenant "
                   "servers: requests with different salts never share prefix-cache blocks)")
    p.add_argument("--served-model-name", help="model name of the API (default: the recipe's serve.served_name, "
                   "else the artifact directory name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences (prompts x n) waiting before the server answers 503; a request of more is a 400 "
                   "(default 1024)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks (default: the manifest's decision, "
                   "as `kiln compile --report` states it)")
    p.add_argument("--max-num-seqs", type=positive_int, metavar="N",
                   help="sequences running at once, at most (default: the recipe's scheduler.max_seqs, 256)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                   help="tokens a step computes, at most, decodes and prefill chunks together (default: the "
                   "artifact's: the recipe's scheduler.max_batched_tokens, else its target's, as `kiln compile "
                   "--report` states it). On a CPU a step of 8192 prompt tokens takes seconds, and every running "
                   "stream waits for it: 1024-2048 there gives a burst of requests their first tokens sooner and "
                   "lets decodes ride along with the prefill chunks")
    p.add_argument("--num-threads", type=int, help="the engine core's intra-op threads (default: every CPU the "
                   "process may run on; the API server itself uses one)")
    p.add_argument("--core-cpus", type=cpu_list, metavar="LIST",
                   help="the CPUs the engine core computes on, e.g. 1-15 (one intra-op thread per CPU unless "
                   "--num-threads); the API server then runs on the other CPUs it may use, so that HTTP, "
                   "detokenization and streaming never preempt the core's threads. With --data-parallel-size or "
                   "--disaggregate each core gets a disjoint slice of LIST (default: the core computes on every CPU "
                   "and the API server shares them)")
    p.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="send a stream's tokens every N (its first token and its end at once); fewer, larger SSE "
                        "events: less CPU per token in the API server and the client, coarser inter-token timing "
                        "(default 1: every token)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the artifact's prefix cache off")
    p.add_argument("--kv-offload", type=byte_size, metavar="SIZE",
                   help="host memory of the CPU offload tier, where evicted prefix-cache blocks go and come back from "
                   "on a hit instead of being recomputed, e.g. 16GiB (split over a tensor-parallel artifact's ranks); 0 "
                   "turns it off (default: the recipe's kv_cache.offload)")
    p.add_argument("--disaggregate", action="store_true",
                   help="serve through a router over one prefill and one decode engine core on this machine (the "
                   "recipe's disaggregate section, else transport tcp, remote_prefill auto)")
    p.add_argument("--remote-prefill", choices=["always", "never", "auto"],
                   help="with --disaggregate: prefill every prompt on the prefill core (always), none (never), or "
                   "only those whose uncached part would stall the decode core longer than a budget at its measured "
                   "prefill speed, while the prefill queue has room (auto) (default: the recipe's, else auto)")
    p.add_argument("--data-parallel-size", "--replicas", dest="replicas", type=int, default=1, metavar="N",
                   help="N replicas behind one KV-aware router that sends each request where its prompt's prefix is "
                   "cached, balanced against load: each an engine core (for a parallel artifact with its own ranks: "
                   "TP=2 x N; on CUDA its own GPUs), or with --disaggregate a prefill + decode pair (default 1)")
    p.add_argument("--router-policy", choices=["kv", "round_robin"], default="kv",
                   help="with --data-parallel-size: route by cached prefix against load (kv), or round robin (for A/B "
                   "measurements) (default kv)")
    p.add_argument("--kv-transport", choices=["tcp", "nixl"],
                   help="with --disaggregate: how KV moves from prefill to decode (default: the recipe's)")
    p.add_argument("--role", choices=["prefill", "decode", "both"],
                   help="run one engine core for a router on another machine (`kiln router`): its control endpoint "
                   "on --host/--port, a decode core's KV receiver on --kv-host/--kv-port; no HTTP API (default: "
                   "serve the API here)")
    p.add_argument("--kv-host", help="with --role decode: the address the KV receiver binds and the prefill cores "
                   "connect to (default --host)")
    p.add_argument("--kv-port", type=port_number, help="with --role decode and tcp: the KV receiver's port (default: a "
                   "free one)")
    add_security_args(p)
    p.add_argument("--speculative", choices=["mtp", "ngram", "draft", "eagle", "none"],
                   help="speculative decoding: the artifact's MTP draft head, n-gram prompt lookup, a draft model "
                   "or an EAGLE head (--speculative-model), or none (default: the recipe's)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="draft tokens a step, verified in one forward pass (default: the recipe's speculative.tokens)")
    p.add_argument("--speculative-model", help="with --speculative draft: a compiled artifact of a smaller model "
                   "sharing the tokenizer; with eagle: an EAGLE-1/2 or EAGLE-3 head's checkpoint (default: the "
                   "recipe's)")
    p.add_argument("--kv-reserve", choices=["reasoning", "all", "none"],
                   help="which requests are admitted only with KV for their whole budget (prompt + max_tokens) and "
                   "never preempted: those with a thinking budget, all, or none (default: the recipe's "
                   "scheduler.kv_reserve, else reasoning)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous one's tokens are read back, overlapping "
                   "host work with the device (default: the recipe's, else on for CUDA, off for CPU)")
    p.add_argument("--tool-parser", help="how the model writes tool calls: hermes, llama3_json, mistral, "
                   "deepseek_v3, ... or none (default: what the chat template implies)")
    p.add_argument("--json-whitespace", choices=["compact", "bounded", "any"], default="compact",
                   help="whitespace JSON grammars (json_object, json_schema, tool calls without a parser) allow "
                   "between tokens: compact (none, separators ',' and ':'; default), bounded (at most 2 in a row) "
                   "or any (up to the engine's grammar_max_whitespace, 8)")
    p.add_argument("--reasoning-parser", help="the model's thinking block: think (<think>), mistral ([THINK]) or none "
                   "(default: what the chat template implies)")
    p.add_argument("--reasoning-effort", type=effort_table, metavar="EFFORT=TOKENS,...",
                   help="thinking budgets of reasoning_effort values, e.g. low=512,medium=2048,high=8192, over the "
                   "recipe's serve.reasoning_effort (default: none=0, minimal=0, low=1024, medium=2048, high=8192)")
    p.set_defaults(func=run_serve)


def add_generate_args(p: argparse.ArgumentParser) -> None:
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
    p.set_defaults(func=run_generate)


def serve_address(manifest: dict, host: str | None, port: int | None) -> tuple[str, int]:
    """The flags, else the manifest's `serve` host and port (the recipe's, else the compiler's defaults)."""
    serve = manifest["serve"]
    return host or serve["host"], port or serve["port"]


def launched_worker(artifact: str) -> int | None:
    """Under a torchrun-style launch (RANK, WORLD_SIZE set) every rank runs the same command: rank 0 is the engine,
    and a rank > 0 becomes that artifact's rank worker here (runtime/worker/distributed/worker.py); None on rank 0."""
    import os

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or int(os.environ["RANK"]) == 0:
        return None
    from .worker.distributed.worker import main

    return main([str(artifact)])


def disaggregate_section(manifest: dict, args: argparse.Namespace) -> dict | None:
    """`kiln serve`'s disaggregation: None (co-located), else the recipe's section (or one prefill and one decode
    core, transport tcp, remote_prefill auto) with the flags over it."""
    if not (args.disaggregate or args.kv_transport or args.remote_prefill):
        return None
    disaggregate = dict(manifest.get("disaggregate") or
                        {"prefill": 1, "decode": 1, "transport": "auto", "remote_prefill": "auto"})
    if args.kv_transport:
        disaggregate["transport"] = args.kv_transport
    if args.remote_prefill:
        disaggregate["remote_prefill"] = args.remote_prefill
    return disaggregate


def lora_roots(args: argparse.Namespace) -> list[str] | None:
    """`--enable-lora-loading --lora-roots DIR[,DIR]`: where clients may load adapters from (None: nowhere)."""
    from .errors import RequestError

    roots = [d for d in (args.lora_roots or "").split(",") if d]
    if args.enable_lora_loading != bool(roots):
        raise RequestError("--enable-lora-loading needs --lora-roots DIR[,DIR] (the directories adapters may be read "
                           "from), and --lora-roots needs --enable-lora-loading")
    return roots or None


def run_serve(args: argparse.Namespace) -> int:
    from .ipc import curve
    from .launch import serve
    from .manifest import read_manifest

    status = launched_worker(args.artifact)
    if status is not None:
        return status

    manifest = read_manifest(args.artifact)
    host, port = serve_address(manifest, args.host, args.port)
    keys = curve.use(args.curve_keys)  # checked before anything starts; the cores inherit KILN_CURVE_KEYS
    if args.replicas < 1:
        from .errors import RequestError
        raise RequestError(f"--data-parallel-size {args.replicas}: give at least 1")
    if args.role is not None:  # one core on the network, for `kiln router` (runtime/disagg/remote.py)
        from .disagg.remote import serve_core
        from .disagg.service import resolve_transport
        from .launch import core_config

        transport = args.kv_transport or (manifest.get("disaggregate") or {}).get("transport", "tcp")
        config = core_config(args.artifact, max_waiting=args.max_waiting, num_threads=args.num_threads,
                             cpus=args.core_cpus, stream_interval=args.stream_interval, num_kv_blocks=args.num_kv_blocks, prefix_cache=not args.no_prefix_cache,
                             speculative=args.speculative, async_scheduling=args.async_scheduling,
                             kv_reserve=args.kv_reserve, num_speculative_tokens=args.num_speculative_tokens,
                             speculative_model=args.speculative_model, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, lora_roots=lora_roots(args))
        return serve_core(config, args.role, host, port, kv_transport=resolve_transport(transport),
                          kv_host=args.kv_host, kv_port=args.kv_port, keys=keys, insecure=args.insecure)
    # reasoning_effort budgets: the recipe's (in the manifest), then the flag's, over the defaults
    efforts = {**(manifest["serve"].get("reasoning_effort") or {}), **(args.reasoning_effort or {})}
    disaggregate = disaggregate_section(manifest, args)
    if disaggregate is not None and disaggregate.get("transport") == "nixl":
        curve.warn_nixl(keys, exposed=False)
    return serve(args.artifact, host=host, port=port, api_key=args.api_key,
                 served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                 num_kv_blocks=args.num_kv_blocks, log_level=args.log_level, prefix_cache=not args.no_prefix_cache,
                 speculative=args.speculative, async_scheduling=args.async_scheduling, kv_reserve=args.kv_reserve,
                 metrics_public=args.metrics_public, num_threads=args.num_threads, tool_parser=args.tool_parser,
                 reasoning_parser=args.reasoning_parser, reasoning_efforts=efforts or None, disaggregate=disaggregate,
                 replicas=args.replicas, router_policy=args.router_policy,
                 num_speculative_tokens=args.num_speculative_tokens, speculative_model=args.speculative_model,
                 kv_offload=args.kv_offload, stream_interval=args.stream_interval, core_cpus=args.core_cpus,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 require_cache_salt=args.require_cache_salt, lora_roots=lora_roots(args),
                 json_whitespace=args.json_whitespace)


def _token_ids(text: str) -> list[int]:
    """`--token-ids` prompts: integers separated by spaces or commas."""
    from .errors import RequestError

    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise RequestError(f"--token-ids: the prompt must be token ids separated by spaces or commas, got {text!r:.60}")
    return [int(p) for p in parts]


def run_generate(args: argparse.Namespace) -> int:
    from .errors import RequestError
    from .llm import LLM
    from .sampling_params import SamplingParams

    status = launched_worker(args.artifact)
    if status is not None:
        return status
    llm = LLM(str(args.artifact))
    if llm.get_tokenizer() is None and not args.token_ids:
        raise RequestError(f"{args.artifact} has no tokenizer (compiled with random weights and no `tokenizer = "
                           "\"hf:DIR\"`); give the prompt as token ids: --token-ids \"1 2 3\"")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
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


def run(args: argparse.Namespace) -> int:
    """Runs a parsed command; a user's error (kiln.errors.KilnError) is printed without a traceback (exit 2)."""
    from kiln.errors import KilnError

    try:
        return args.func(args)
    except KilnError as e:
        print(e.format(), file=sys.stderr)
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
