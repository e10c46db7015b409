"""`kiln serve` and `kiln router` composed: the engine core (one, a prefill/decode pair, or replicas behind a
router: runtime/disagg) started with the options given, and the API server's app (api/app.py) served over it
until interrupted or until the core is gone. The API server package (api/) knows nothing of how its engine was
started; this module is where the two meet."""
from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import threads
from .api.app import build_app
from .api.async_engine import AsyncLLMEngine
from .api.chat_plan import resolve_parsers
from .errors import KilnRuntimeError, RequestError
from .ipc.client import CoreProcess
from .ipc.protocol import CoreConfig, CoreInfo
from .thinking import effort_budgets


def startup_line(info: CoreInfo, model_name: str, url: str) -> str:
    """What `kiln serve` prints once loaded: the model, the target, the KV pool and the tokens it holds."""
    limits = info.limits
    kv_bytes, kv_blocks, block_size = info.kv_bytes, limits.num_blocks, limits.block_size
    return (f"kiln serve: model {model_name!r} ({info.arch or '?'}, {info.artifact}) on target {info.target} "
            f"({info.device}, engine core pid {info.pid}, {info.num_threads} threads"
            + (f" on CPUs {threads.format_cpu_list(info.cpus)}" if info.cpus else "") + f"); KV pool {kv_bytes} bytes "
            f"({kv_bytes / 2**30:.2f} GiB) = {kv_blocks} blocks x {block_size} tokens = {kv_blocks * block_size} "
            f"tokens; max_model_len {limits.max_model_len}; {info.max_seqs} sequences and {info.max_batched_tokens} "
            f"tokens a step; listening on {url}")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The line `kiln serve` prints when it listens beyond loopback with no API key (None: it does not)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        loopback = False
    if loopback or api_key:
        return None
    return (f"kiln serve: WARNING: listening on {host} without --api-key: anyone who can reach it can run "
            "completions on this model and read /metrics (docs/server.md, \"Exposure\"); give --api-key KEY or bind "
            "127.0.0.1")


def engine_options(*, num_kv_blocks: int | None = None, prefix_cache: bool = True, speculative: str | None = None,
                   async_scheduling: bool | None = None, **more: Any) -> dict[str, Any]:
    """EngineCore keyword arguments from `kiln serve`'s options (only those set: the rest are the artifact's)."""
    options = {k: v for k, v in more.items() if v is not None}
    if num_kv_blocks is not None:
        options["num_kv_blocks"] = num_kv_blocks
    if not prefix_cache:
        options["prefix_cache"] = None
    if speculative is not None:
        options["speculative"] = speculative
    if async_scheduling is not None:
        options["async_scheduling"] = async_scheduling
    return options


def core_config(artifact: str | Path, *, max_waiting: int = 1024, num_threads: int | None = None,
                stream_interval: int = 1, cpus: list[int] | None = None, **options: Any) -> CoreConfig:
    """The engine core's configuration for `kiln serve`'s options (engine_options). `cpus` (`--core-cpus`) are
    checked here: every one must be a CPU this process may run on (RequestError, a user's error, if not)."""
    if cpus is not None:
        try:
            threads.check_cpus(cpus)
        except ValueError as e:
            raise RequestError(str(e)) from None
    return CoreConfig(artifact=str(artifact), max_waiting=max_waiting, num_threads=num_threads, cpus=cpus,
                      stream_interval=stream_interval, engine=engine_options(**options))


def check_port(host: str, port: int) -> None:
    """Fails (a user's error) if the HTTP server could not listen on host:port, before anything is loaded: a bind
    as uvicorn's (SO_REUSEADDR, so a port a stopped server left in TIME_WAIT passes), at once closed again."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KilnRuntimeError(f"--host {host!r}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise KilnRuntimeError(f"cannot listen on {host}:{port}: {e.strerror} (another server on that port? "
                                   "give another --port)") from None


def _stop_on_sigterm() -> None:
    """SIGTERM (how a process manager stops a server) stops `kiln serve` as Ctrl-C does while it starts: the cores
    it started are stopped and their socket directories removed (uvicorn then handles it as SIGINT too)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's Server, but a SIGINT or SIGTERM that stopped it is not raised again once it has shut down (uvicorn
    re-raises it: SIGTERM's default action then killed `kiln serve`, exit 143, before its cores were stopped and
    their socket directories removed). A second SIGINT still forces the exit (uvicorn's handle_exit)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    return Server(config)


def serve(artifact: str | Path, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = 1024, num_kv_blocks: int | None = None,
          log_level: str = "info", prefix_cache: bool = True, speculative: str | None = None,
          async_scheduling: bool | None = None, kv_reserve: str | None = None, metrics_public: bool = False,
          num_threads: int | None = None, tool_parser: str | None = None, reasoning_parser: str | None = None,
          reasoning_efforts: dict[str, int] | None = None, disaggregate: dict | None = None, replicas: int = 1,
          router_policy: str = "kv", num_speculative_tokens: int | None = None,
          speculative_model: str | None = None, kv_offload: int | None = None, stream_interval: int = 1,
          core_cpus: list[int] | None = None, max_num_seqs: int | None = None,
          max_num_batched_tokens: int | None = None, require_cache_salt: bool = False,
          lora_roots: list[str] | None = None, json_whitespace: str = "compact") -> int:
    """`kiln serve`: starts the engine core, then serves until interrupted (exit status 0) or until the core
    dies (every request in flight gets an error, then exit status 1). `prefix_cache=False` turns the
    artifact's prefix cache off (for A/B measurements); `speculative` ("mtp", "ngram", "draft" with
    `speculative_model`, "none"; `num_speculative_tokens` a step) overrides the recipe's;
    `async_scheduling` (None: the recipe's, else on for CUDA) overlaps host work with the device; `kv_reserve`
    (None: the recipe's) says which requests are admitted only with KV for their whole budget (scheduler.py);
    `metrics_public` leaves `/metrics` open when an `api_key` is set; `num_threads`: the core's intra-op
    threads (default: every CPU this process may use; threads.py); `tool_parser` / `reasoning_parser` /
    `reasoning_efforts`: see OpenAIServer. `disaggregate` (the manifest's section, see runtime/disagg): a router
    over one prefill and one decode core instead of one core. `replicas` > 1 (`--data-parallel-size`): that many
    replicas (cores, each with its own ranks for a parallel artifact, or pairs) behind a KV-aware router
    (runtime/disagg/router.py; `router_policy` "round_robin" for A/B measurements). `kv_offload`: bytes of the CPU
    offload tier (None: the recipe's; 0: none; runtime/core/kv_offload.py). `stream_interval`: a stream's tokens are
    sent every that many (its first and last at once; core/process.py: StreamCoalescer). `core_cpus`
    (`--core-cpus`): the CPUs the engine core computes on (several cores: disjoint slices of them); this process,
    the API server, then runs on the CPUs it may use that they were not given (threads.py). `max_num_seqs` /
    `max_num_batched_tokens` (None: the recipe's scheduler section) bound the sequences running at once and the
    tokens of a step. `require_cache_salt`: requests without a `cache_salt` are refused (OpenAIServer).
    `lora_roots` (`--enable-lora-loading --lora-roots`): where clients may load adapters from (None: run-time
    adapter loading is off). `json_whitespace` (`--json-whitespace`): the whitespace JSON grammars allow
    between tokens, "compact" (none), "bounded" or "any" (grammar_spec.JSON_WHITESPACE)."""

    resolve_parsers(None, tool_parser, reasoning_parser)  # an unknown name fails before the core is started
    check_port(host, port)  # so does a port in use
    _stop_on_sigterm()
    effort_budgets(reasoning_efforts)  # so does a bad effort table
    threads.configure_api_server()
    config = core_config(artifact, max_waiting=max_waiting, num_threads=num_threads, stream_interval=stream_interval,
                         cpus=core_cpus, num_kv_blocks=num_kv_blocks, prefix_cache=prefix_cache, speculative=speculative, async_scheduling=async_scheduling,
                         kv_reserve=kv_reserve, num_speculative_tokens=num_speculative_tokens,
                         speculative_model=speculative_model, kv_offload_bytes=kv_offload, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, lora_roots=lora_roots)
    with contextlib.ExitStack() as stack:
        if replicas > 1:  # a KV-aware router over several replicas (runtime/disagg/router.py)
            from .disagg.router import start_replicas
            engine = start_replicas(stack, config, replicas, disaggregate, policy=router_policy)
        elif disaggregate is None:
            engine = AsyncLLMEngine.from_process(stack.enter_context(CoreProcess.start(config)))
        else:  # a router over a prefill and a decode core (runtime/disagg)
            from .disagg.service import start_disaggregated
            engine = start_disaggregated(stack, config, disaggregate)
        more = []
        api_cpus = threads.place_api_server(core_cpus)  # after the cores started: they inherited the full mask
        if api_cpus:
            more.append(f"kiln serve: the API server runs on CPUs {threads.format_cpu_list(api_cpus)}")
        if replicas > 1:
            pids = ", ".join(str(r.engine.info.pid) for r in engine.replicas)
            more.append(f"kiln serve: {replicas} replicas behind a KV-aware router (engine core pids {pids}; the "
                        "line above is replica 0's)")
        return run_app(engine, host=host, port=port, log_level=log_level, more_lines=more,
                       served_model_name=served_model_name, api_key=api_key, metrics_public=metrics_public,
                       tool_parser=tool_parser, reasoning_parser=reasoning_parser, reasoning_efforts=reasoning_efforts,
                       require_cache_salt=require_cache_salt, json_whitespace=json_whitespace)


def run_app(engine: AsyncLLMEngine, *, host: str, port: int, log_level: str = "info", more_lines: list[str] = (),
            **app_kw: Any) -> int:
    """Serves `engine` (build_app's `app_kw`) on host:port until interrupted (SIGINT, SIGTERM: 0) or until its core
    is gone (1); prints the startup line (and `more_lines`) once loaded. `kiln serve` and `kiln router`
    (runtime/disagg)."""
    import uvicorn

    app = build_app(engine, **app_kw)
    warning = exposure_warning(host, app_kw.get("api_key"))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(startup_line(engine.info, app.state.server.model_name, f"http://{host}:{port}"), flush=True)
    for line in more_lines:
        print(line, flush=True)
    server = _uvicorn_server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=5))
    engine.on_dead.append(lambda why: setattr(server, "should_exit", True))
    server.run()
    if engine.dead is not None:
        print(f"kiln serve: exiting: the engine core is gone ({engine.dead})", file=sys.stderr, flush=True)
        return 1
    return 0
