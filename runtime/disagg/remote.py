"""Engine cores on separate machines: `kiln serve ART --role prefill|decode|both --host H --port P` runs one core
whose control endpoint (the engine-core protocol's ROUTER socket) and, for a decode core, KV receiver listen on
network addresses; `kiln router --prefill URL ... --decode URL ...` (or `--replica URL ...`) runs the router alone
over such cores.

The router connects to every core first (a probe client: `Welcome` says what the core serves, `disagg_init` its
role and KV layout) and refuses to start (exit 2) on a core of the wrong role, an unreachable one, or a prefill and
a decode core whose KV layouts differ. Every decode core is one replica of the KV-aware router (router.py: its
prefix-cache events are reported by the core); every prefill core serves every decode core, each decode core's
engine its own client of it (transfer ids are uuid4, unique across decode cores; each lease lives on the decode
core that granted it). A remote core is watched by its heartbeats only: one silent for `heartbeat_timeout` is gone;
a decode core's requests then fail, a prefill core's transfers fall back to prefilling on their decode core.
With `--curve-keys DIR` on every core and the router, each of those TCP sockets is CURVE-authenticated and
encrypted (curve.py); without keys, a core or router whose sockets would listen beyond loopback refuses to start
(exit 2) unless given `--insecure`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec

from ..errors import KilnRuntimeError
from ..ipc import curve

ROLES = ("prefill", "decode", "both")
_LOCAL_ONLY = ("0.0.0.0", "::", "")


def core_url(text: str) -> str:
    """`host:port` or `tcp://host:port` -> `tcp://host:port`."""
    url = text if "://" in text else f"tcp://{text}"
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    if not url.startswith("tcp://") or not host or not port.isdigit():
        raise KilnRuntimeError(f"{text!r} is not an engine core's address (host:port or tcp://host:port)")
    return url


# A core serving one role ------------------------------------------------------------------------------------
def serve_core(config, role: str, host: str, port: int, *, kv_transport: str = "tcp",
               kv_host: str | None = None, kv_port: int | None = None, client_timeout: float = 30.0,
               keys: curve.CurveKeys | None = None, insecure: bool = False) -> int:
    """`kiln serve ART --role ROLE --host H --port P`: starts the core (its control endpoint tcp://H:P; a decode
    core's KV receiver on `kv_host` (default H), `kv_port` (default: a free one)) and waits until it exits (1) or
    this process is told to stop (SIGTERM, SIGINT: 0). With `keys` (exported as KILN_CURVE_KEYS to the core) its
    sockets are CURVE; without, a socket beyond loopback is refused unless `insecure`."""
    from ..ipc.client import CoreProcess
    from .router import KV_EVENTS_PLUGIN
    from .service import DECODE_PLUGIN, PREFILL_PLUGIN

    if role not in ROLES:
        raise KilnRuntimeError(f"--role {role!r} (known: {', '.join(ROLES)})")
    plugins = {"prefill": [PREFILL_PLUGIN], "decode": [DECODE_PLUGIN, KV_EVENTS_PLUGIN],
               "both": [KV_EVENTS_PLUGIN]}[role]
    options: dict[str, Any] = {}
    if role == "decode":
        where = kv_host or host
        if kv_transport == "tcp" and where in _LOCAL_ONLY:
            raise KilnRuntimeError(f"--host {host!r} is every interface: give --kv-host, the address the prefill "
                                   "cores reach this machine's KV receiver at")
        options["disagg"] = {"transport": kv_transport,
                             "kv_bind": f"tcp://{where}" + (f":{kv_port}" if kv_port else "")}
    exposed = [("the control endpoint", host)]
    if role == "decode" and kv_transport == "tcp":
        exposed.append(("the KV receiver", kv_host or host))
    curve.refuse_exposed(exposed, keys, insecure, f"kiln serve --role {role}")
    if role == "decode" and kv_transport == "nixl":
        curve.warn_nixl(keys, not curve.is_loopback(host))
    config = msgspec.structs.replace(config, input_address=f"tcp://{host}:{port}", client_timeout=client_timeout,
                                     plugins=[*config.plugins, *plugins], plugin_options=options)
    def on_signal(signum, _frame) -> None:  # SIGTERM stops the core as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    with CoreProcess.start(config) as core:
        info = core.info
        kv = f"; KV over {kv_transport}" if role == "decode" else ""
        kv += f"; CURVE keys {keys.directory}" if keys is not None else "; no authentication"
        print(f"kiln serve: {role} engine core of {info.artifact} (pid {info.pid}, {info.num_threads} threads; KV "
              f"blocks {info.limits.num_blocks} x {info.limits.block_size} tokens) listening on tcp://{host}:{port}"
              f"{kv}", flush=True)
        try:
            core.wait()
        except KeyboardInterrupt:
            return 0
    print(f"kiln serve: the {role} engine core {core.describe_exit()}", file=sys.stderr, flush=True)
    return 1


# The router -----------------------------------------------------------------------------------------------
class Probed(msgspec.Struct):
    url: str
    info: Any  # CoreInfo
    role: str  # prefill | decode | both
    layout: dict | None
    endpoint: str | None


async def probe(url: str, timeout: float = 30.0) -> Probed:
    """Connects to the core at `url` as a client of its own: what it serves, its role and its KV layout."""
    from ..ipc.client import AsyncCoreClient, EngineDeadError
    from ..ipc.protocol import UtilityCall, UtilityResult

    client = AsyncCoreClient(url, name=f"probe-{uuid.uuid4().hex[:8]}")
    try:
        try:
            info = await client.connect(timeout)
        except EngineDeadError:
            raise KilnRuntimeError(f"no engine core answers at {url} (within {timeout:g} s); is `kiln serve ART "
                                   "--role ... --host H --port P` running there?") from None
        client.send(UtilityCall(0, "disagg_init", [{}]))
        while True:
            msg = await asyncio.wait_for(client.recv(), timeout)
            if isinstance(msg, UtilityResult) and msg.call_id == 0:
                break
        info = msgspec.structs.replace(info, input_address=url)
        if msg.error is not None:  # no disaggregation plugin: a co-located core
            return Probed(url, info, "both", None, None)
        role = "decode" if "endpoint" in msg.result else "prefill"
        return Probed(url, info, role, msg.result["layout"], msg.result.get("endpoint"))
    except TimeoutError:
        raise KilnRuntimeError(f"the engine core at {url} did not answer within {timeout:g} s") from None
    finally:
        client.close()


def check_cores(prefill: list[Probed], decode: list[Probed], replicas: list[Probed]) -> None:
    """Each core has the role it is given as, and every prefill core pairs with every decode core."""
    for want, cores in (("prefill", prefill), ("decode", decode), ("both", replicas)):
        for c in cores:
            if c.role != want:
                flag = {"both": "--replica"}.get(want, f"--{want}")
                started = {"both": "--role both"}.get(c.role, f"--role {c.role}")
                raise KilnRuntimeError(f"{flag} {c.url}: that engine core serves the {c.role} role ({started}); "
                                       f"give it as {'--replica' if c.role == 'both' else '--' + c.role}")
    for d in decode:
        for p in prefill:
            if p.layout != d.layout:
                raise KilnRuntimeError(f"the prefill core at {p.url} ({p.info.artifact}) and the decode core at "
                                       f"{d.url} ({d.info.artifact}) have different KV layouts (prefill {p.layout},"
                                       f" decode {d.layout}); they must serve artifacts compiled with the same KV "
                                       "layout")
        if len(prefill) > 1 and (d.endpoint or "").startswith("nixl:"):
            raise KilnRuntimeError(f"the decode core at {d.url} takes KV over NIXL, whose receiver pairs with one "
                                   f"prefill core; {len(prefill)} were given (start it with --kv-transport tcp)")
    first = (decode or replicas)[0]
    for c in [*prefill, *decode, *replicas]:
        if c.info.limits != first.info.limits:
            raise KilnRuntimeError(f"the engine cores at {first.url} and {c.url} serve different limits "
                                   f"({first.info.limits} vs {c.info.limits}); serve the same artifact on all")


def _tokenizer(info, artifact: str | None):
    from ..tokenizer import open_tokenizer

    where = info.tokenizer_dir
    if artifact is not None:
        from ..manifest import read_manifest
        tok = read_manifest(artifact).get("tokenizer")
        where = str(Path(artifact) / tok["dir"]) if tok is not None else None
    elif where is not None and not os.path.isdir(where):
        raise KilnRuntimeError(f"the cores' tokenizer ({where}) is not on this machine: give --artifact, a copy of "
                               "the artifact they serve")
    return open_tokenizer(where, info.limits.vocab_size) if where else None


def build_router(prefill: list[str], decode: list[str], replicas: list[str], *, artifact: str | None = None,
                 remote_prefill: str = "auto", policy: str = "kv", heartbeat_timeout: float = 10.0,
                 probe_timeout: float = 30.0, lease_s: float = 30.0):
    """The router's engine over remote cores (started by the server's lifespan); raises KilnRuntimeError when a
    core is not there, has another role, or will not pair (the KV layout)."""
    from ..api.async_engine import AsyncLLMEngine
    from .router import ReplicaRouter
    from .service import DisaggAsyncEngine

    if bool(replicas) == bool(decode or prefill):
        raise KilnRuntimeError("kiln router: give --prefill URL ... --decode URL ... (disaggregated cores) or "
                               "--replica URL ... (co-located cores), not both and not neither")
    if decode and not prefill:
        raise KilnRuntimeError("kiln router: --decode needs at least one --prefill core")
    if prefill and not decode:
        raise KilnRuntimeError("kiln router: --prefill needs at least one --decode core")

    async def probe_all() -> list[list[Probed]]:
        return [[await probe(core_url(u), probe_timeout) for u in urls] for urls in (prefill, decode, replicas)]

    p, d, r = asyncio.run(probe_all())
    check_cores(p, d, r)
    tokenizer = _tokenizer((d or r)[0].info, artifact)
    me = uuid.uuid4().hex[:8]  # client names unique per router: two routers may share a core
    kw = {"heartbeat_timeout": heartbeat_timeout}
    if r:
        engines = [AsyncLLMEngine(c.info, tokenizer, client_name=f"router-{me}-r{k}", **kw) for k, c in enumerate(r)]
    else:
        transport = "nixl" if (d[0].endpoint or "").startswith("nixl:") else "tcp"
        engines = [DisaggAsyncEngine(c.info, tokenizer, client_name=f"router-{me}-d{k}", remote_prefill=remote_prefill,
                                     transport=transport, lease_s=lease_s, **kw,
                                     prefill=[AsyncLLMEngine(q.info, None, client_name=f"router-{me}-d{k}-p{j}", **kw)
                                              for j, q in enumerate(p)])
                   for k, c in enumerate(d)]
    return ReplicaRouter(engines, policy=policy)


def add_router_args(sub) -> None:
    from ..cli_args import add_security_args, port_number

    p = sub.add_parser("router", help="a KV-aware router over engine cores on other machines (kiln serve ART --role "
                       "prefill|decode|both --host H --port P)")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill core (repeat for more; each serves every decode core) (default: none)")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a decode core (repeat for more: each a replica of the KV-aware router) (default: none)")
    p.add_argument("--replica", action="append", default=[], metavar="HOST:PORT",
                   help="a co-located core (--role both; repeat for more), instead of --prefill/--decode (default: none)")
    p.add_argument("--artifact", help="a copy of the artifact the cores serve, for its tokenizer (default: the "
                   "cores' own path, when this machine has it)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API binds (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="the HTTP API's TCP port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the /v1 routes and /metrics (default: no "
                   "key)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--served-model-name", help="model name of the API (default: the artifact's served name, else its directory name)")
    p.add_argument("--remote-prefill", choices=["always", "never", "auto"], default="auto",
                   help="prefill every prompt on a prefill core, none, or by the decode core's measured speed and "
                   "the prefill queue (default auto)")
    p.add_argument("--router-policy", choices=["kv", "round_robin"], default="kv",
                   help="route by cached prefix against load (kv) or round robin (default kv)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="a core silent this many seconds is gone: its requests fail (default 10)")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds each core has to answer the router at its start (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's log level (default info)")
    add_security_args(p)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from .. import threads
    from ..launch import run_app

    threads.configure_api_server()
    keys = curve.use(args.curve_keys)  # the router's clients of the cores read KILN_CURVE_KEYS
    urls = [core_url(u) for u in (*args.prefill, *args.decode, *args.replica)]
    curve.refuse_exposed([(f"its output socket for the core at {u}", u.removeprefix("tcp://").rpartition(":")[0])
                          for u in urls], keys, args.insecure, "kiln router")
    engine = build_router(args.prefill, args.decode, args.replica, artifact=args.artifact,
                          remote_prefill=args.remote_prefill, policy=args.router_policy,
                          heartbeat_timeout=args.heartbeat_timeout, probe_timeout=args.connect_timeout)
    cores = (f"{len(args.prefill)} prefill and {len(args.decode)} decode" if args.decode else
             f"{len(args.replica)} co-located")
    return run_app(engine, host=args.host, port=args.port, log_level=args.log_level,
                   more_lines=[f"kiln router: over {cores} engine core(s) at "
                               f"{', '.join([*args.prefill, *args.decode, *args.replica])}"],
                   served_model_name=args.served_model_name, api_key=args.api_key, metrics_public=args.metrics_public)
