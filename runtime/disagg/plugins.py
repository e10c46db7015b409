"""The engine-core side of disaggregation and of the KV-aware router: plugins a core process loads by spec
(`--plugin kiln.runtime.disagg.plugins:decode_plugin`, ...; core/process.py `_load_plugin`).

`decode_plugin` / `prefill_plugin` give a core the utilities `disagg_init` (sets the role up: the decode core binds
its KV receiver and returns its endpoint and KV layout), `disagg_add` / `disagg_prefill` (one request's two
halves), `disagg_fail` and `disagg_stats`, and a poller that takes KV frames between steps (roles.py does the
work). `kv_events_plugin` lets the router follow a replica's prefix cache (router.py).
"""
from __future__ import annotations

import time
from typing import Any

import msgspec

from ..errors import KilnRuntimeError, RequestError
from ..ipc.curve import is_loopback
from ..ipc.protocol import decode_params
from .roles import DecodeRole, PrefillRole
from .transport import TRANSPORTS, KVLayout, RemotePrefill, Transport, ZmqTransport


def make_receiver(kind: str, block_bytes: int, bind: str = "tcp://127.0.0.1", max_blocks: int = 0) -> Transport:
    """The decode side's receiving end of a `kind` transport; its `endpoint` goes to the prefill side. A NIXL
    slot holds the largest frame: a block's (the payload and < 200 header bytes) or the `Done` of a transfer of
    `max_blocks` blocks (18 bytes a digest). NIXL has no address to bind: a loopback `bind` keeps its UCX on the
    loopback device."""
    largest = max(block_bytes, 24 * max_blocks) + 1024
    if kind == "tcp":
        return ZmqTransport.bind(bind, max_frame_bytes=largest)
    if kind == "nixl":
        from .nixl_transport import NixlReceiver
        host = bind.removeprefix("tcp://")
        host = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
        return NixlReceiver(slot_bytes=largest, loopback=is_loopback(host))
    raise KilnRuntimeError(f"unknown KV transport {kind!r} (known: {', '.join(TRANSPORTS)})")


def connect(endpoint: str) -> Transport:
    """The prefill side's sending end for a decode side's `endpoint`."""
    if endpoint.startswith("nixl:"):
        from .nixl_transport import NixlSender
        return NixlSender(endpoint)
    return ZmqTransport(endpoint, bind=False)


def decode_plugin(proc) -> None:
    state: dict[str, DecodeRole] = {}

    def init(engine, config: dict) -> dict:
        """`config` from the router (transport, lease_s); a core serving its role on the network (`kiln serve
        --role decode`) has its own in `plugin_options["disagg"]`, which win (transport, and `kv_bind`: where
        its receiver binds, e.g. tcp://10.0.0.5 or tcp://10.0.0.5:9100)."""
        config = {**config, **proc.config.plugin_options.get("disagg", {})}
        if "role" not in state:
            limits = engine.limits
            receiver = make_receiver(config.get("transport", "tcp"), KVLayout.of(engine).block_bytes,
                                     bind=config.get("kv_bind", "tcp://127.0.0.1"),
                                     max_blocks=limits.max_model_len // limits.block_size + 1)
            state["role"] = DecodeRole(engine, receiver, lease_s=float(config.get("lease_s", 30.0)),
                                       endpoint=receiver.endpoint)
        role = state["role"]
        return {"endpoint": role.endpoint, "layout": msgspec.to_builtins(role.layout)}

    def add(engine, request_id: str, prompt: list[int], params: bytes, transfer_id: str, priority: int = 0,
            policy: dict | None = None) -> dict:
        """`policy`: `min_remote_tokens`, `local_reason` (DecodeRole.add_request). Returns the descriptor (None:
        prefilled here), the decision and the prompt tokens past this core's prefix-cache hit."""
        role = state["role"]
        try:
            desc = role.add_request(request_id, prompt, decode_params(msgspec.Raw(params)), transfer_id,
                                    priority=priority, **(policy or {}))
        except msgspec.ValidationError as e:
            raise RequestError(str(e)) from None
        proc._unscheduled[request_id] = time.monotonic()
        return {"desc": None if desc is None else msgspec.to_builtins(desc), "decision": role.last_decision,
                "uncached": role.uncached}

    def poll() -> None:
        role = state.get("role")
        if role is None:
            return
        sched = role.engine.scheduler
        idle = role.pending and not (sched.running or sched.waiting)
        role.poll(0.002 if idle else 0.0)  # waiting only on transfers: wait for frames, do not spin

    proc.register_utility("disagg_init", init)
    proc.register_utility("disagg_add", add)
    proc.register_utility("disagg_fail", lambda engine, tids: state["role"].fail(list(tids)))
    proc.register_utility("disagg_stats", lambda engine: _decode_stats(state["role"]))
    proc.pollers.append(poll)


def _decode_stats(role: DecodeRole) -> dict[str, Any]:
    return {"decisions": dict(role.decisions), "fallbacks": dict(role.fallbacks), "transfers": dict(role.ledger.counts),
            "blocks": role.check(),
            "leases": len(role.ledger.leases), "pending": len(role.pending), "bad_frames": role.num_bad_frames,
            "dropped": dict(role.dropped.counts),
            "bytes_received": role.bytes_received,
            "transfer_seconds": {"counts": role.transfer_counts, "sum": role.transfer_seconds}}


def prefill_plugin(proc) -> None:
    state: dict[str, PrefillRole] = {}

    def init(engine, config: dict) -> dict:
        if "role" not in state:
            state["role"] = PrefillRole(engine, connect)
        return {"layout": msgspec.to_builtins(state["role"].layout)}

    def prefill(engine, request_id: str, prompt: list[int], desc: dict) -> None:
        state["role"].add(request_id, prompt, msgspec.convert(desc, RemotePrefill))

    proc.register_utility("disagg_init", init)
    proc.register_utility("disagg_prefill", prefill)
    proc.register_utility("disagg_stats", lambda engine: {"counts": dict(state["role"].counts),
                                                          "bytes_sent": state["role"].bytes_sent,
                                                          "blocks_free": engine.block_manager.num_free_blocks})


def kv_events_plugin(proc) -> None:
    """Core plugin: the utility `kv_events(full)` returns `{"full": [hash, ...]}` (everything cached now; when
    `full`, on the first call, or after a cache reset) or `{"events": [(published?, hash), ...]}` (what changed
    since the previous call, oldest first)."""

    def kv_events(engine, full: bool = False) -> dict[str, Any]:
        cache = engine.block_manager.prefix_cache
        if cache is None:
            return {"full": []}
        cache.record_events()
        events = cache.take_events()
        if full or events is None:
            return {"full": cache.cached_hashes()}
        return {"events": events}

    proc.register_utility("kv_events", kv_events)
