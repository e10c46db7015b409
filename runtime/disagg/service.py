"""Disaggregation across processes, the router's side: the engine that pairs a prefill and a decode core.

The cores run their roles as plugins (plugins.py: `disagg_init`, `disagg_add` / `disagg_prefill`, `disagg_fail`,
`disagg_stats`, and a poller that takes KV frames between steps). The router (`DisaggAsyncEngine`, an `AsyncLLMEngine` whose requests go
through the decode core) asks the decode core to reserve, hands the descriptor to the prefill core, and streams
the decode core's deltas as they come: it never waits for the prefill core's answer beyond its acceptance.
A prefill core that dies or refuses costs no request: its transfers are failed on the decode core at once, and
those requests prefill there.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from typing import Any

import msgspec

from .. import threads
from ..api.async_engine import AsyncLLMEngine, EngineOverloadedError, PromptInput
from ..errors import KilnRuntimeError, RequestError
from ..ipc.protocol import AddResult, encode_params
from ..sampling_params import SamplingParams
from .transport import TRANSFER_BUCKETS

logger = logging.getLogger(__name__)

SEP = "\x1f"  # core/process.py: SEP (not imported: that module binds sockets at import time of its users)
REMOTE_PREFILL = ("always", "never", "auto")
# the cores' plugins (plugins.py), by spec: this process never imports them (they load torch)
DECODE_PLUGIN = "kiln.runtime.disagg.plugins:decode_plugin"
PREFILL_PLUGIN = "kiln.runtime.disagg.plugins:prefill_plugin"


_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


def _histogram(name: str, doc: str):
    """A histogram of the router's own, in no registry (its collector yields it into the server's)."""
    from prometheus_client import Histogram
    return Histogram(name, doc, buckets=_TTFT_BUCKETS, registry=None)





class DisaggAsyncEngine(AsyncLLMEngine):
    """The router's engine over one decode core (`self`: its deltas are the requests' outputs) and one or more
    prefill cores (`self.prefills`, AsyncLLMEngines used for their utilities and liveness only; `self.prefill` is
    the first). Each remote prefill goes to the live prefill core with the fewest transfers in flight; one that
    dies fails only its own transfers (they fall back to the decode core) and the others carry on."""

    def __init__(self, *args: Any, prefill: AsyncLLMEngine | list[AsyncLLMEngine], remote_prefill: str = "auto",
                 transport: str = "tcp",
                 lease_s: float = 30.0, local_prefill_budget_s: float = 0.05, max_local_prefill: int = 256,
                 max_prefill_queue: int = 64, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if remote_prefill not in REMOTE_PREFILL:
            raise KilnRuntimeError(f"disaggregate.remote_prefill = {remote_prefill!r} (known: {', '.join(REMOTE_PREFILL)})")
        self.prefills = list(prefill) if isinstance(prefill, list) else [prefill]
        self.remote_prefill = remote_prefill
        self.lease_s = lease_s
        self.transport = transport
        self.transfers: dict[str, str] = {}  # request id -> transfer id, while its prefill may be in flight
        self._prefill_of: dict[str, AsyncLLMEngine] = {}  # transfer id -> the prefill core computing it
        self.prefill_errors = 0
        self.disagg_stats: dict[str, Any] = {}
        # Conditional disaggregation (`auto`): a prompt is prefilled on the decode core when what is left of it
        # past the decode core's prefix-cache hit takes at most `local_prefill_budget_s` there, at the decode
        # core's measured prefill speed (`max_local_prefill` tokens until it was measured), or when
        # `max_prefill_queue` remote prefills are in flight already.
        self.local_prefill_budget_s = local_prefill_budget_s
        self.max_local_prefill = max_local_prefill
        self.max_prefill_queue = max_prefill_queue
        self.local_prefill_tps: float | None = None  # the decode core's prefill speed (tokens/s, EWMA)
        # request id -> [decision, added at, uncached tokens, first token at, seconds in the decode core's queue],
        # until its first token was timed
        self._first_token: dict[str, list] = {}
        # one per request, counted here the moment it is made (the decode core's answer to `disagg_add`, or the
        # router's own: `never`, every prefill core gone), so /metrics is exact once the request is admitted
        self.decisions: Counter[str] = Counter()
        # The transfer counters come from the decode core (`disagg_stats`): a request whose transfer ended but whose
        # end the snapshot may not show yet is `unsettled`; its finishing output is held until a snapshot taken
        # after the transfer ended arrived, so that started == succeeded + failed + expired + aborted once every
        # request finished. A transfer has ended on the decode core when its request's first output comes (the
        # request is scheduled only then) or the router aborted it.
        self._unsettled: set[str] = set()  # request ids
        self._ended: set[str] = set()  # unsettled ones whose transfer has ended: the next snapshot shows them
        self._held: list = []  # step outputs, in order, waiting for that snapshot
        self._refreshing: asyncio.Task | None = None
        self.ttft = {path: _histogram(f"kiln:{path}_prefill_ttft_seconds", f"Time to first token of requests "
                                      f"prefilled {where}.") for path, where in
                     (("remote", "on the prefill core"), ("local", "on the decode core"))}

    @property
    def prefill(self) -> AsyncLLMEngine:
        return self.prefills[0]

    async def start(self) -> None:
        await super().start()
        decode = await self.call_utility("disagg_init", {"lease_s": self.lease_s, "transport": self.transport})
        for core in self.prefills:
            await core.start()
            core.on_dead.append(lambda why, core=core: self._prefill_died(core, why))
            prefill = await core.call_utility("disagg_init", {})
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
        for core in self.prefills:
            await core.shutdown()
        await super().shutdown()

    def _pick_prefill(self) -> AsyncLLMEngine | None:
        """The live prefill core with the fewest transfers in flight (None: none is live)."""
        live = [core for core in self.prefills if core.is_running]
        if not live:
            return None
        load = {id(core): 0 for core in live}
        for core in self._prefill_of.values():
            if id(core) in load:
                load[id(core)] += 1
        return min(live, key=lambda core: load[id(core)])

    async def _queue(self, inputs: list[PromptInput], params: SamplingParams,
                     lora_name: str | None = None) -> AddResult:
        if lora_name is not None:  # the prefill core would compute the base model's K/V
            raise RequestError("LoRA adapters are not served by a disaggregated server yet; serve the artifact "
                               "without --disaggregate")
        if self.remote_prefill == "never" or not any(core.is_running for core in self.prefills):
            result = await super()._queue(inputs, params)
            if result.error is None:
                why = "remote_prefill_never" if self.remote_prefill == "never" else "no_prefill_core"
                self.decisions["local:" + why] += len(inputs)
            return result
        raw = bytes(encode_params(params))
        added: list[str] = []
        for p in inputs:
            tid = uuid.uuid4().hex
            timing = self._first_token[p.request_id] = [None, time.monotonic(), 0, None, 0.0]
            try:
                reply = await self.call_utility("disagg_add", self.client_name + SEP + p.request_id,
                                                p.prompt_token_ids, raw, tid, 0, self.policy())
            except EngineOverloadedError:  # the decode core is gone: 503
                self._first_token.pop(p.request_id, None)
                raise
            except KilnRuntimeError as e:  # the decode core refused it: all of the group or none
                self._first_token.pop(p.request_id, None)
                if added:
                    self.abort(added)
                return AddResult(0, str(e).partition("core: ")[2] or str(e))
            added.append(p.request_id)
            desc = reply["desc"]
            timing[0], timing[2] = reply["decision"], reply["uncached"]
            self.decisions[reply["decision"]] += 1
            if desc is not None:  # a transfer started: its end is to be in the snapshot before the request ends
                self._unsettled.add(p.request_id)
            if timing[3] is not None:  # its first token came before this coroutine resumed
                self._observe_first_token(p.request_id)
            core = self._pick_prefill()
            if desc is None or core is None:
                if desc is not None:  # every prefill core died meanwhile
                    await self.call_utility("disagg_fail", [tid])
                continue
            self.transfers[p.request_id] = tid
            self._prefill_of[tid] = core
            try:
                await core.call_utility("disagg_prefill", core.client_name + SEP + tid, p.prompt_token_ids, desc)
            except KilnRuntimeError as e:  # the decode core prefills it itself
                self.prefill_errors += 1
                logger.warning("the prefill core refused transfer %s: %s", tid, e)
                self.transfers.pop(p.request_id, None)
                self._prefill_of.pop(tid, None)
                await self.call_utility("disagg_fail", [tid])
        return AddResult(0)

    def policy(self) -> dict[str, Any]:
        """What the decode core is told for the next request (DecodeRole.add_request). On a cold start (no short
        prompt prefilled on the decode core yet, so no speed measured) the threshold is `max_local_prefill` tokens
        and a prompt kept local for it is counted as `local:short_prompt_unmeasured`; it is also what measures the
        speed."""
        if self.remote_prefill == "always":
            return {}
        if len(self.transfers) >= self.max_prefill_queue:
            return {"local_reason": "prefill_queue_full"}
        return {"min_remote_tokens": self.local_prefill_threshold,
                "short_reason": "short_prompt" if self.local_prefill_tps is not None else "short_prompt_unmeasured"}

    @property
    def local_prefill_threshold(self) -> int:
        """Prompt tokens the decode core prefills within `local_prefill_budget_s` at its measured speed."""
        if self.local_prefill_tps is None:
            return self.max_local_prefill
        return int(self.local_prefill_tps * self.local_prefill_budget_s)

    def _first_tokens(self, deltas) -> None:
        now = time.monotonic()
        for d in deltas:
            timing = self._first_token.get(d.request_id)
            if timing is None:
                continue
            if not d.token_ids:  # it ended without a token (an error)
                if d.finish_reason is not None:
                    del self._first_token[d.request_id]
                continue
            timing[3] = now
            if timing[0] is not None:
                self._observe_first_token(d.request_id)

    def _observe_first_token(self, request_id: str) -> None:
        """TTFT per path; a short prompt prefilled on the decode core measures that core's prefill speed."""
        timing = self._first_token.pop(request_id, None)
        if timing is None:  # aborted meanwhile
            return
        decision, added, uncached, first, queued = timing
        seconds = max(first - added, 1e-6)
        self.ttft["remote" if decision == "remote" else "local"].observe(seconds)
        if decision in ("local:short_prompt", "local:short_prompt_unmeasured"):  # its compute time: the time it waited in the queue is not speed
            tps = uncached / max(seconds - queued, 1e-6)
            self.local_prefill_tps = tps if self.local_prefill_tps is None else 0.8 * self.local_prefill_tps + 0.2 * tps

    def abort(self, request_ids: list[str]) -> None:
        super().abort(request_ids)
        for r in request_ids:
            self._first_token.pop(r, None)
            if r in self._unsettled:  # the decode core ends its lease with the abort, sent before the refresh
                self._unsettled.discard(r)
                self._ended.add(r)
        self._release_held()
        self._refresh_soon()
        per_core: dict[int, tuple[AsyncLLMEngine, list[str]]] = {}
        for r in request_ids:
            tid = self.transfers.pop(r, None)
            core = self._prefill_of.pop(tid, None) if tid is not None else None
            if core is not None:
                per_core.setdefault(id(core), (core, []))[1].append(tid)
        for core, tids in per_core.values():
            if core.is_running:
                core.abort(tids)  # ids of the prefill core's own requests

    def _on_step(self, msg) -> None:
        for d in msg.deltas:
            if d.request_id in self._unsettled:
                self._ended.add(d.request_id)
        if self._held or self._must_hold(msg):
            self._held.append(msg)
        else:
            self._deliver(msg)
        self._refresh_soon()

    def _must_hold(self, msg) -> bool:
        return any((d.finish_reason is not None or d.error is not None) and d.request_id in self._unsettled
                   for d in msg.deltas)

    def _release_held(self) -> None:
        while self._held and not self._must_hold(self._held[0]):
            self._deliver(self._held.pop(0))

    def _refresh_soon(self) -> None:
        if self._ended and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = self.loop.create_task(self._refresh_stats())

    async def _refresh_stats(self) -> None:
        """Takes a snapshot that shows every ended transfer, then passes on the outputs held for it (also when the
        decode core does not answer: it is gone, and the outputs say so)."""
        while self._ended:
            covered, self._ended = self._ended, set()
            if self.is_running:
                with contextlib.suppress(Exception):
                    self.disagg_stats = await self.call_utility("disagg_stats", timeout=5.0)
            self._unsettled -= covered
            self._release_held()

    def _deliver(self, msg) -> None:
        super()._on_step(msg)
        for d in msg.deltas:  # decode has started: its prefill is over (or never came)
            tid = self.transfers.pop(d.request_id, None)
            if tid is not None:
                self._prefill_of.pop(tid, None)
        if self._first_token:
            self._note_queued(msg.scheduled)
            self._first_tokens(msg.deltas)

    def _note_queued(self, scheduled: list[tuple[str, float]]) -> None:
        """(request id, seconds in the decode core's waiting queue) of the requests it scheduled in a step."""
        for request_id, waited in scheduled:
            timing = self._first_token.get(request_id)
            if timing is not None:
                timing[4] = waited

    def _prefill_died(self, core: AsyncLLMEngine, why: str) -> None:
        tids = [tid for tid, c in self._prefill_of.items() if c is core]
        for tid in tids:
            del self._prefill_of[tid]
        gone = set(tids)
        self.transfers = {r: tid for r, tid in self.transfers.items() if tid not in gone}
        logger.error("a prefill core is gone (%s): %d transfer(s) fall back to decode-side prefill", why, len(tids))
        if tids and self.is_running:
            self.loop.create_task(self.call_utility("disagg_fail", tids))


class _DisaggCollector:
    """kiln:kv_transfer_{started,succeeded,failed,expired,aborted}_total, kiln:kv_transfer_bytes_total,
    kiln:prefill_decisions_total{decision} (remote, local:<reason>: one per request, counted by the router),
    kiln:prefill_fallbacks_total{state} (remote ones prefilled on the decode core after all). The decode core's
    kiln:kv_blocks{state} comes with its core stats (metrics.py)."""

    def __init__(self, engine: DisaggAsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        s = self.engine.disagg_stats
        transfers = s.get("transfers", {})
        for what in ("started", "succeeded", "failed", "expired", "aborted"):
            family = CounterMetricFamily(f"kiln:kv_transfer_{what}", f"KV transfers {what} (decode side).")
            family.add_metric([], transfers.get(what, 0))
            yield family
        family = CounterMetricFamily("kiln:kv_transfer_bytes", "KV bytes written into leased blocks.")
        family.add_metric([], s.get("bytes_received", 0))
        yield family
        family = CounterMetricFamily("kiln:prefill_decisions", "Where prompts were prefilled, and why.",
                                     labels=["decision"])
        for decision, n in self.engine.decisions.items():
            family.add_metric([decision], n)
        yield family
        family = CounterMetricFamily("kiln:prefill_fallbacks", "Remote prefills done on the decode core after all, "
                                     "by how their transfer ended.", labels=["state"])
        for state, n in s.get("fallbacks", {}).items():
            family.add_metric([state], n)
        yield family
        buckets = s.get("transfer_seconds")
        if buckets:  # the decode core's: lease reserved -> committed
            family = HistogramMetricFamily("kiln:kv_transfer_seconds", "KV transfers, reservation to commit "
                                           "(decode side).", sum_value=buckets["sum"],
                                           buckets=list(zip(map(str, (*TRANSFER_BUCKETS, "+Inf")),
                                                            itertools.accumulate(buckets["counts"]))))
            yield family
        family = GaugeMetricFamily("kiln:local_prefill_threshold_tokens", "Conditional disaggregation: prompts "
                                   "with at most this many tokens past the decode core's prefix-cache hit are "
                                   "prefilled there (source: measured, from its prefill speed; default, "
                                   "max_local_prefill until a speed was measured).", labels=["source"])
        family.add_metric(["default" if self.engine.local_prefill_tps is None else "measured"],
                          self.engine.local_prefill_threshold)
        yield family
        for histogram in self.engine.ttft.values():
            yield from histogram.collect()


def resolve_transport(kind: str) -> str:
    return "tcp" if kind == "auto" else kind


def start_disaggregated(stack, config, disaggregate: dict, *, heartbeat_timeout: float = 10.0) -> DisaggAsyncEngine:
    """`kiln serve --disaggregate`: starts a decode core and `disaggregate["prefill"]` (1) prefill cores (each
    `config` plus its role's plugin, each pinned to a disjoint slice of `config.cpus`, else of the CPUs this process
    may use, its threads that slice's share unless `config.num_threads` is set) under `stack`, and returns the
    router's engine over them (started by the server's lifespan)."""
    from ..ipc.client import CoreProcess
    from ..tokenizer import open_tokenizer

    num_prefill = int(disaggregate.get("prefill", 1))
    transport = resolve_transport(disaggregate.get("transport", "auto"))
    if num_prefill > 1 and transport != "tcp":  # a NIXL receiver's staging ring has one sender's credits
        raise KilnRuntimeError(f"disaggregate.prefill = {num_prefill} needs transport = tcp (NIXL pairs one prefill "
                               "core with a decode core here)")
    cpus = config.cpus or threads.allowed_cpus()
    slices = threads.split_cpus(cpus, num_prefill + 1)  # decode first, then each prefill core: disjoint CPUs
    num_threads = config.num_threads or max(1, len(cpus) // (num_prefill + 1))

    def role_config(role: str, k: int):
        return msgspec.structs.replace(config, num_threads=num_threads, input_address="",
                                       cpus=slices[k] if slices else config.cpus,
                                       plugins=[*config.plugins, {"prefill": PREFILL_PLUGIN, "decode": DECODE_PLUGIN}[role]])
    # One after the other, from this thread: a core dies with the *thread* that started it (PR_SET_PDEATHSIG
    # follows the creating thread), so starting them from a pool's threads would kill them when those exit.
    decode = stack.enter_context(CoreProcess.start(role_config("decode", 0)))
    prefills = [stack.enter_context(CoreProcess.start(role_config("prefill", 1 + k))) for k in range(num_prefill)]
    info = decode.info
    tokenizer = open_tokenizer(info.tokenizer_dir, info.limits.vocab_size) if info.tokenizer_dir else None
    engines = [AsyncLLMEngine(core.info, None, process=core, client_name="router-p",
                              heartbeat_timeout=heartbeat_timeout) for core in prefills]
    tuning = {k: disaggregate[k] for k in ("local_prefill_budget_s", "max_local_prefill", "max_prefill_queue")
              if k in disaggregate}
    return DisaggAsyncEngine(info, tokenizer, process=decode, prefill=engines, **tuning,
                             remote_prefill=disaggregate.get("remote_prefill", "auto"), transport=transport,
                             lease_s=float(disaggregate.get("lease_s", 30.0)), heartbeat_timeout=heartbeat_timeout)
