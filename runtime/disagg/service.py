"""Disaggregation across processes: the roles as engine-core plugins, and the router's engine.

A core started with the plugin `kiln.runtime.disagg.service:decode_plugin` (or `prefill_plugin`) gains the
utilities `disagg_init` (sets the role up: the decode core binds its KV receiver and returns its endpoint and
KV layout), `disagg_add` / `disagg_prefill` (one request's two halves), `disagg_fail` and `disagg_stats`, and a
poller that takes KV frames between steps. The router (`DisaggAsyncEngine`, an `AsyncLLMEngine` whose requests go
through the decode core) asks the decode core to reserve, hands the descriptor to the prefill core, and streams
the decode core's deltas as they come: it never waits for the prefill core's answer beyond its acceptance.
A prefill core that dies or refuses costs no request: its transfers are failed on the decode core at once, and
those requests prefill there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec

from ..async_engine import AsyncLLMEngine, EngineOverloadedError, PromptInput
from ..core_protocol import AddResult, decode_params, encode_params
from ..errors import KilnRuntimeError, RequestError
from ..sampling_params import SamplingParams
from .roles import DecodeRole, PrefillRole, RemotePrefill
from .transport import Transport, ZmqTransport

logger = logging.getLogger(__name__)

SEP = "\x1f"  # core_process.SEP (not imported: that module binds sockets at import time of its users)
REMOTE_PREFILL = ("always", "never", "auto")


TRANSPORTS = ("tcp", "nixl")


def make_receiver(kind: str, block_bytes: int, bind: str = "tcp://127.0.0.1") -> Transport:
    """The decode side's receiving end of a `kind` transport; its `endpoint` goes to the prefill side."""
    if kind == "tcp":
        return ZmqTransport.bind(bind)
    if kind == "nixl":
        from .nixl_transport import NixlReceiver
        return NixlReceiver(slot_bytes=block_bytes + 1024)  # a block frame: the payload and < 200 header bytes
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
        if "role" not in state:
            from .roles import KVLayout
            receiver = make_receiver(config.get("transport", "tcp"), KVLayout.of(engine).block_bytes)
            state["role"] = DecodeRole(engine, receiver, lease_s=float(config.get("lease_s", 30.0)),
                                       endpoint=receiver.endpoint)
        role = state["role"]
        return {"endpoint": role.endpoint, "layout": msgspec.to_builtins(role.layout)}

    def add(engine, request_id: str, prompt: list[int], params: bytes, transfer_id: str, priority: int = 0):
        role = state["role"]
        try:
            desc = role.add_request(request_id, prompt, decode_params(msgspec.Raw(params)), transfer_id,
                                    priority=priority)
        except msgspec.ValidationError as e:
            raise RequestError(str(e)) from None
        proc._unscheduled[request_id] = time.monotonic()
        return None if desc is None else msgspec.to_builtins(desc)

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
    return {"decisions": dict(role.decisions), "transfers": dict(role.ledger.counts), "blocks": role.check(),
            "leases": len(role.ledger.leases), "pending": len(role.pending), "bad_frames": role.num_bad_frames,
            "bytes_received": role.bytes_received}


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


class DisaggAsyncEngine(AsyncLLMEngine):
    """The router's engine over one decode core (`self`: its deltas are the requests' outputs) and one prefill
    core (`self.prefill`, an AsyncLLMEngine used for its utilities and liveness only)."""

    def __init__(self, *args: Any, prefill: AsyncLLMEngine, remote_prefill: str = "always", transport: str = "tcp",
                 lease_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if remote_prefill not in REMOTE_PREFILL:
            raise KilnRuntimeError(f"disaggregate.remote_prefill = {remote_prefill!r} (known: {', '.join(REMOTE_PREFILL)})")
        self.prefill = prefill
        self.remote_prefill = remote_prefill
        self.lease_s = lease_s
        self.transport = transport
        self.transfers: dict[str, str] = {}  # request id -> transfer id, while its prefill may be in flight
        self.prefill_errors = 0
        self.disagg_stats: dict[str, Any] = {}

    async def start(self) -> None:
        await super().start()
        await self.prefill.start()
        self.prefill.on_dead.append(self._prefill_died)
        decode = await self.call_utility("disagg_init", {"lease_s": self.lease_s, "transport": self.transport})
        prefill = await self.prefill.call_utility("disagg_init", {})
        if decode["layout"] != prefill["layout"]:
            raise KilnRuntimeError(f"the prefill and decode cores' KV layouts differ ({prefill['layout']} vs "
                                   f"{decode['layout']}); they must serve artifacts with the same KV layout")
        self._tasks.append(asyncio.ensure_future(self._poll_stats()))

    async def _poll_stats(self) -> None:
        """The decode core's transfer counters and block states, for /metrics (read at scrape time)."""
        while True:
            if self.is_running:
                with contextlib.suppress(Exception):
                    self.disagg_stats = await self.call_utility("disagg_stats", timeout=5.0)
            await asyncio.sleep(self.heartbeat_interval)

    @property
    def metrics_collectors(self) -> list:
        return [_DisaggCollector(self)]

    async def shutdown(self) -> None:
        await self.prefill.shutdown()
        await super().shutdown()

    async def _queue(self, inputs: list[PromptInput], params: SamplingParams,
                     lora_name: str | None = None) -> AddResult:
        if lora_name is not None:  # the prefill core would compute the base model's K/V
            raise RequestError("LoRA adapters are not served by a disaggregated server yet; serve the artifact "
                               "without --disaggregate")
        if self.remote_prefill == "never" or not self.prefill.is_running:
            return await super()._queue(inputs, params)
        raw = bytes(encode_params(params))
        added: list[str] = []
        for p in inputs:
            tid = uuid.uuid4().hex
            try:
                desc = await self.call_utility("disagg_add", self.client_name + SEP + p.request_id,
                                               p.prompt_token_ids, raw, tid)
            except EngineOverloadedError:  # the decode core is gone: 503
                raise
            except KilnRuntimeError as e:  # the decode core refused it: all of the group or none
                if added:
                    self.abort(added)
                return AddResult(0, str(e).partition("core: ")[2] or str(e))
            added.append(p.request_id)
            if desc is None:
                continue
            self.transfers[p.request_id] = tid
            try:
                await self.prefill.call_utility("disagg_prefill", self.prefill.client_name + SEP + tid,
                                                p.prompt_token_ids, desc)
            except KilnRuntimeError as e:  # the decode core prefills it itself
                self.prefill_errors += 1
                logger.warning("the prefill core refused transfer %s: %s", tid, e)
                self.transfers.pop(p.request_id, None)
                await self.call_utility("disagg_fail", [tid])
        return AddResult(0)

    def abort(self, request_ids: list[str]) -> None:
        super().abort(request_ids)
        tids = [self.transfers.pop(r) for r in request_ids if r in self.transfers]
        if tids and self.prefill.is_running:
            self.prefill.abort([tid for tid in tids])  # ids of the prefill core's own requests

    def _on_step(self, msg) -> None:
        super()._on_step(msg)
        for d in msg.deltas:  # decode has started: its prefill is over (or never came)
            self.transfers.pop(d.request_id, None)

    def _prefill_died(self, why: str) -> None:
        tids = list(self.transfers.values())
        self.transfers.clear()
        logger.error("the prefill core is gone (%s): %d transfer(s) fall back to decode-side prefill", why, len(tids))
        if tids and self.is_running:
            self.loop.create_task(self.call_utility("disagg_fail", tids))


class _DisaggCollector:
    """kiln:kv_transfer_{started,succeeded,failed,expired,aborted}_total, kiln:kv_transfer_bytes_total,
    kiln:kv_blocks{state}, kiln:prefill_decisions_total{decision} (remote, local:<reason>, fallback:<state>)."""

    def __init__(self, engine: DisaggAsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.disagg_stats
        transfers = s.get("transfers", {})
        for what in ("started", "succeeded", "failed", "expired", "aborted"):
            family = CounterMetricFamily(f"kiln:kv_transfer_{what}", f"KV transfers {what} (decode side).")
            family.add_metric([], transfers.get(what, 0))
            yield family
        family = CounterMetricFamily("kiln:kv_transfer_bytes", "KV bytes written into leased blocks.")
        family.add_metric([], s.get("bytes_received", 0))
        yield family
        family = GaugeMetricFamily("kiln:kv_blocks", "Decode-side KV blocks by state.", labels=["state"])
        for state, n in s.get("blocks", {}).items():
            family.add_metric([state], n)
        yield family
        family = CounterMetricFamily("kiln:prefill_decisions", "Where prompts were prefilled, and why.",
                                     labels=["decision"])
        for decision, n in s.get("decisions", {}).items():
            family.add_metric([decision], n)
        yield family


def resolve_transport(kind: str) -> str:
    return "tcp" if kind == "auto" else kind


def start_disaggregated(stack, config, disaggregate: dict, *, heartbeat_timeout: float = 10.0) -> DisaggAsyncEngine:
    """`kiln serve --disaggregate`: starts a decode and a prefill core (each `config` plus its role's plugin;
    the CPUs this process may use split between them unless `config.num_threads` is set) under `stack`, and
    returns the router's engine over them (started by the server's lifespan)."""
    import os

    from ..artifact import open_tokenizer
    from ..core_client import CoreProcess

    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // 2)
    configs = {role: msgspec.structs.replace(config, num_threads=threads, input_address="",
                                             plugins=[*config.plugins, f"kiln.runtime.disagg.service:{role}_plugin"])
               for role in ("decode", "prefill")}
    # One after the other, from this thread: a core dies with the *thread* that started it (PR_SET_PDEATHSIG
    # follows the creating thread), so starting them from a pool's threads would kill them when those exit.
    cores = {role: stack.enter_context(CoreProcess.start(cfg)) for role, cfg in configs.items()}
    info = cores["decode"].info
    tokenizer = open_tokenizer(info.tokenizer_dir, info.limits.vocab_size) if info.tokenizer_dir else None
    prefill = AsyncLLMEngine(cores["prefill"].info, None, process=cores["prefill"], client_name="router-p",
                             heartbeat_timeout=heartbeat_timeout)
    return DisaggAsyncEngine(info, tokenizer, process=cores["decode"], prefill=prefill,
                             remote_prefill=disaggregate.get("remote_prefill", "always"),
                             transport=resolve_transport(disaggregate.get("transport", "auto")),
                             lease_s=float(disaggregate.get("lease_s", 30.0)), heartbeat_timeout=heartbeat_timeout)
