"""The KV-aware router over several engine-core replicas (`kiln serve ART --replicas N`): each request goes to the
replica whose prefix cache holds the longest prefix of its prompt, balanced against that replica's load.

What a replica holds comes from the replica: the core plugin `kv_events_plugin` (plugins.py) has its prefix cache record every
block hash it publishes and evicts, and the router drains those events every `index_interval` seconds (utility
`kv_events`; a full snapshot at the start and after a lost answer or a cache reset). Between two drains the blocks
of the prompts the router just sent are *predicted* on their replica (for `predict_ttl` seconds, or until the
replica reports them evicted), so a burst of requests sharing a prefix follows the first one before its replica
has reported anything. The block hashes are the cores' own (block_hash.block_hashes: a chain of 16-byte digests
over token blocks, salted by the request's cache_salt, the same in every process), so the router matches exactly
what a core's lookup would.

Cost of replica r: the request's estimated time to first token there plus the time its own prefill delays the
requests that queue behind it, `(queued_r + running_r + (1 + prefill_weight) * uncached_r) / speed_r`
(prefill_weight 1), where `uncached_r` is the prompt tokens r would compute (not cached there), `queued_r` the uncached
tokens of r's requests still waiting for their first token, `running_r` its requests past it (one decode token each
in every step this prefill shares) — all counted by the router itself, immediate, never stale — and `speed_r`
r's measured prefill speed: a request's uncached tokens (plus one per request running beside it) per second of its
time to first token, averaged over the requests that had no prefill queued ahead of them (a request behind others
would measure r's batching, which grows with its load: a loaded replica would look fast and draw more) and at least
MIN_SPEED_SAMPLE tokens to compute (a short one measures fixed per-request costs), and until r has one the other
replicas' mean (none measured: 1).
A prefix hit thus saves what its tokens take to compute there (for this request and for those behind it), and no
more: a replica holding the prefix behind a queue loses to an idle one when the queue costs more than the hit
saves. (With prefill_weight 0 — this request's TTFT alone — a chat whose replica had one prefill queued moved to
the other replica and then stayed there with its history: chats drifted onto one replica, 8 / 24 requests.) The cheapest live replica wins; ties go
to fewer requests in flight, then round robin. A
replica whose core dies fails only its own requests (its AsyncLLMEngine's liveness: process sentinel and
heartbeats) and is skipped from then on; the router is down only when every replica is. A replica may be a
co-located core (AsyncLLMEngine) or a disaggregated pair (service.DisaggAsyncEngine).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .. import threads
from ..api.async_engine import (
    AsyncLLMEngine,
    EngineOverloadedError,
    PromptInput,
    RequestGroup,
    RequestObserver,
)
from ..block_hash import BlockHash, block_hashes
from ..errors import KilnRuntimeError
from ..ipc.protocol import CoreStats
from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KV_EVENTS_PLUGIN = "kiln.runtime.disagg.plugins:kv_events_plugin"  # by spec: plugins.py loads torch
POLICIES = ("kv", "round_robin")
# a speed sample needs this many tokens to compute: below it a request's TTFT is mostly fixed per-request cost
# (RPC, the step), and identical replicas measured 2-3x apart, which sent every request to the one that looked fast
MIN_SPEED_SAMPLE = 256  # round_robin: the baseline for benchmarks (no cache or load awareness)





class ReplicaIndex:
    """The block hashes one replica holds, as the router knows them: reported (its events) and predicted (sent
    there, not reported yet)."""

    def __init__(self, predict_ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.predict_ttl = predict_ttl
        self.clock = clock
        self.reported: set[BlockHash] = set()
        self.predicted: dict[BlockHash, float] = {}  # hash -> until when it is believed

    def apply(self, answer: dict[str, Any]) -> None:
        if "full" in answer:
            self.reported = set(answer["full"])
            for h in self.reported:
                self.predicted.pop(h, None)
            return
        reported, predicted = self.reported, self.predicted
        for published, h in answer["events"]:
            if published:
                reported.add(h)
                predicted.pop(h, None)
            else:
                reported.discard(h)
                predicted.pop(h, None)

    def predict(self, hashes: list[BlockHash]) -> None:
        until = self.clock() + self.predict_ttl
        for h in hashes:
            if h not in self.reported:
                self.predicted[h] = until

    def expire(self) -> None:
        now = self.clock()
        for h in [h for h, until in self.predicted.items() if until < now]:
            del self.predicted[h]

    def match(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` the replica holds (reported or predicted)."""
        now, n = self.clock(), 0
        for h in hashes:
            if h not in self.reported and self.predicted.get(h, -1.0) < now:
                break
            n += 1
        return n

    def clear(self) -> None:
        self.reported.clear()
        self.predicted.clear()


@dataclass(slots=True)
class Load:
    queued: int = 0  # uncached prompt tokens of the replica's requests still waiting for their first token
    running: int = 0  # its requests past their first token
    requests: int = 0  # both (plus requests being added)


@dataclass(slots=True)
class Routed:
    """One request as the router sent it to a replica."""

    uncached: int  # prompt tokens the replica had to compute (not cached there, as the router believed)
    load: Load  # the replica's load when it was routed there
    at: float  # when (the router's clock)
    measured: bool = False  # its time to first token went into the replica's speed


class Replica:
    """The router's view of one replica: its engine, its index, its requests in flight and its prefill speed."""

    def __init__(self, name: str, engine: AsyncLLMEngine, index: ReplicaIndex) -> None:
        self.name = name
        self.engine = engine
        self.index = index
        self.groups: list[tuple[RequestGroup, dict[str, Routed]]] = []
        self.adding: dict[int, int] = {}  # uncached tokens of groups being added (routed, not accepted yet)
        # EWMAs of the tokens a first token needed and of the seconds it took (requests with nothing queued ahead)
        self.measured_tokens = self.measured_seconds = 0.0
        self.num_routed = 0
        self.num_matched_blocks = 0
        self.num_index_errors = 0

    @property
    def speed(self) -> float | None:
        """Prefill tokens per second of time to first token (None: nothing measured yet)."""
        return self.measured_tokens / self.measured_seconds if self.measured_seconds > 0 else None

    def _measure(self, routed: Routed, first_token_at: float) -> None:
        routed.measured = True
        seconds = first_token_at - routed.at
        tokens = routed.uncached + routed.load.running
        if seconds <= 0 or routed.load.queued or tokens < MIN_SPEED_SAMPLE:
            return
        if self.measured_seconds == 0:
            self.measured_tokens, self.measured_seconds = float(tokens), seconds
        else:
            self.measured_tokens = 0.8 * self.measured_tokens + 0.2 * tokens
            self.measured_seconds = 0.8 * self.measured_seconds + 0.2 * seconds

    def load(self) -> Load:
        """What is in flight here; measures the speed from requests whose first token came and forgets finished
        groups."""
        load = Load(queued=sum(self.adding.values()), requests=len(self.adding))
        kept = []
        for g, routed in self.groups:
            for request_id, r in routed.items():
                started = g.first_token_at.get(request_id)
                if started is not None and not r.measured:
                    self._measure(r, started)
                if request_id in g.unfinished:
                    load.requests += 1
                    if started is None:
                        load.queued += r.uncached
                    else:
                        load.running += 1
            if g.unfinished:
                kept.append((g, routed))
        self.groups = kept
        return load


class ReplicaRouter:
    """Stands where an AsyncLLMEngine stands for the API server (runtime/api/serving.py): `add_requests` picks a replica
    and returns that replica's RequestGroup (its aborts go to that replica); stats are summed over live replicas."""

    def __init__(self, engines: list[AsyncLLMEngine], *, policy: str = "kv", prefill_weight: float = 1.0,
                 index_interval: float = 0.2, predict_ttl: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert engines, "a router needs at least one replica"
        if policy not in POLICIES:
            raise KilnRuntimeError(f"router policy {policy!r} (known: {', '.join(POLICIES)})")
        self.policy = policy
        self.replicas = [Replica(str(i), e, ReplicaIndex(predict_ttl, clock)) for i, e in enumerate(engines)]
        first = engines[0]
        self.info, self.tokenizer, self.max_waiting = first.info, first.tokenizer, first.max_waiting
        self.block_size = first.info.limits.block_size
        self.clock = clock
        self.prefill_weight = prefill_weight
        self.index_interval = index_interval
        self.on_dead: list[Callable[[str], None]] = []
        self.dead: str | None = None
        self.routed: OrderedDict[str, str] = OrderedDict()  # recent request id -> replica name
        self._observer: RequestObserver = first.observer
        self._turn = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # The AsyncLLMEngine surface the server uses ---------------------------------------------------------------
    @property
    def observer(self) -> RequestObserver:
        return self._observer

    @observer.setter
    def observer(self, observer: RequestObserver) -> None:
        self._observer = observer
        for r in self.replicas:
            r.engine.observer = observer

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.replicas[0].engine.loop

    @property
    def is_running(self) -> bool:
        return any(r.engine.is_running for r in self.replicas)

    @property
    def stats(self) -> CoreStats:
        live = [r.engine.stats for r in self.replicas if r.engine.is_running] or [CoreStats()]
        total = CoreStats(*(sum(getattr(s, f) for s in live) for f in CoreStats.__struct_fields__))
        total.kv_cache_usage = sum(s.kv_cache_usage for s in live) / len(live)
        return total

    @property
    def metrics_collectors(self) -> list:
        return [_RouterCollector(self)]

    async def start(self) -> None:
        for r in self.replicas:
            await r.engine.start()
            r.engine.on_dead.append(lambda why, r=r: self._replica_died(r, why))
        self._tasks = [asyncio.ensure_future(self._follow(r)) for r in self.replicas]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self.replicas:
            await r.engine.shutdown()

    def check_admissible(self, num_prompts: int, params: SamplingParams) -> None:
        self.replicas[0].engine.check_admissible(num_prompts, params)

    async def add_requests(self, inputs: list[PromptInput], params: SamplingParams,
                           lora_name: str | None = None) -> RequestGroup:
        """Queues the prompts (all of them, on one replica) on the cheapest live replica that takes them; a
        replica that is overloaded or just died is passed over for the next. `RequestError` is the client's."""
        if lora_name is None:  # the cores' keys: salted as the cores salt them
            hashes = [block_hashes(p.prompt_token_ids, self.block_size, [], cache_salt=params.cache_salt)[
                :(len(p.prompt_token_ids) - 1) // self.block_size] for p in inputs]
        else:  # a core roots an adapter's blocks at its own id for the loaded adapter: the router cannot match them
            hashes = [[] for _ in inputs]
        error: EngineOverloadedError | None = None
        for replica, matched in self.rank(hashes, [len(p.prompt_token_ids) for p in inputs]):
            uncached = [len(p.prompt_token_ids) - m * self.block_size for p, m in zip(inputs, matched, strict=True)]
            load = replica.load()
            key = id(uncached)  # counted as queued while the replica accepts it (other routings run meanwhile)
            replica.adding[key] = sum(uncached)
            try:
                group = await replica.engine.add_requests(inputs, params, lora_name)
            except EngineOverloadedError as e:  # its queue is full, or it is gone: the next one
                error = e
                continue
            finally:
                del replica.adding[key]
            now = self.clock()
            replica.groups.append((group, {p.request_id: Routed(u, load, now) for p, u in
                                           zip(inputs, uncached, strict=True)}))
            replica.num_routed += len(inputs)
            replica.num_matched_blocks += sum(matched)
            for h in hashes:
                replica.index.predict(h)
            for p in inputs:
                self.routed[p.request_id] = replica.name
            while len(self.routed) > 4096:
                self.routed.popitem(last=False)
            return group
        raise error or EngineOverloadedError(f"no replica is running ({self.dead or 'none started'})")

    def rank(self, hashes: list[list[BlockHash]], lengths: list[int] | None = None) -> list[tuple[Replica, list[int]]]:
        """Live replicas, cheapest first, with the leading blocks of each prompt each is believed to hold.

        Cost: the estimated time to first token there plus the delay its prefill adds behind it, `(queued + running
        + (1 + prefill_weight) * uncached) / speed` (the module's docstring); `lengths` are the prompts' tokens (default: their whole blocks)."""
        live = [r for r in self.replicas if r.engine.is_running]
        if not live:
            return []
        turn = next(self._turn)
        if self.policy == "round_robin":  # the baseline the KV-aware policy is measured against
            order = live[turn % len(live):] + live[:turn % len(live)]
            return [(r, [r.index.match(h) for h in hashes]) for r in order]
        bs = self.block_size
        lengths = lengths or [len(h) * bs for h in hashes]
        speeds = [s for s in (r.speed for r in live) if s is not None]
        default_speed = sum(speeds) / len(speeds) if speeds else 1.0
        scored = []
        for k, r in enumerate(live):
            matched = [r.index.match(h) for h in hashes]
            uncached = sum(n - m * bs for n, m in zip(lengths, matched, strict=True))
            load = r.load()
            work = load.queued + load.running + (1 + self.prefill_weight) * uncached
            cost = work / (r.speed or default_speed)
            scored.append((cost, load.requests, (k - turn) % len(live), r, matched))
        scored.sort(key=lambda s: s[:3])
        return [(s[3], s[4]) for s in scored]

    def abort(self, request_ids: list[str]) -> None:
        for r in self.replicas:
            r.engine.abort(request_ids)

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Runs a core utility on every live replica (LoRA adapters are loaded on all); returns the first's, or the
        first refusal ({"error": ...}) or failure of any replica: a replica that refused is never hidden behind
        another's success. A `load_lora_adapter` some replica refused is unloaded from those that took it, so
        the replicas keep serving the same adapters."""
        live = [r.engine for r in self.replicas if r.engine.is_running]
        if not live:
            raise EngineOverloadedError(f"no replica is running ({self.dead or 'none started'})")
        results = await asyncio.gather(*(e.call_utility(method, *args, timeout=timeout) for e in live),
                                       return_exceptions=True)
        failed = [x for x in results if isinstance(x, BaseException) or (isinstance(x, dict) and "error" in x)]
        if not failed:
            return results[0]
        if method == "load_lora_adapter":
            took = [e for e, x in zip(live, results) if isinstance(x, dict) and "error" not in x]
            await asyncio.gather(*(e.call_utility("unload_lora_adapter", args[0], timeout=timeout) for e in took),
                                 return_exceptions=True)
        if isinstance(failed[0], BaseException):
            raise failed[0]
        return failed[0]

    # Following the replicas ----------------------------------------------------------------------------------
    async def _follow(self, r: Replica) -> None:
        """Drains the replica's prefix-cache events into its index, every `index_interval` seconds."""
        full = True
        while r.engine.is_running:
            try:
                r.index.apply(await r.engine.call_utility("kv_events", full, timeout=5.0))
                full = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an answer lost (or no plugin): the next asks for everything
                r.num_index_errors += 1
                if r.num_index_errors == 1:
                    logger.warning("replica %s: its prefix-cache events are not available (%s); routing on "
                                   "predictions", r.name, e)
                full = True
            r.index.expire()
            await asyncio.sleep(self.index_interval)

    def _replica_died(self, r: Replica, why: str) -> None:
        r.index.clear()
        live = [x.name for x in self.replicas if x.engine.is_running]
        logger.error("replica %s is gone (%s); %d replica(s) left", r.name, why, len(live))
        if not live and self.dead is None:
            self.dead = f"every replica is gone (the last: {why})"
            for callback in self.on_dead:
                callback(self.dead)


class _RouterCollector:
    """Per replica: kiln:router_replica_up, kiln:router_requests_total, kiln:router_matched_tokens_total (prompt
    tokens the router expected cached where it sent them), kiln:replica_prefix_cache_{queries,hits}_total (tokens,
    the replica's own counters), kiln:replica_num_requests_{running,waiting}."""

    def __init__(self, router: ReplicaRouter) -> None:
        self.router = router

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        bs = self.router.block_size
        families = {
            "up": GaugeMetricFamily("kiln:router_replica_up", "1 while the replica's engine core runs.",
                                    labels=["replica"]),
            "routed": CounterMetricFamily("kiln:router_requests", "Requests the router sent to the replica.",
                                          labels=["replica"]),
            "matched": CounterMetricFamily("kiln:router_matched_tokens", "Prompt tokens the router expected the "
                                           "replica's prefix cache to hold when it chose it.", labels=["replica"]),
            "queries": CounterMetricFamily("kiln:replica_prefix_cache_queries", "Prompt tokens the replica looked "
                                           "up in its prefix cache (whole blocks).", labels=["replica"]),
            "hits": CounterMetricFamily("kiln:replica_prefix_cache_hits", "Prompt tokens the replica's prefix "
                                        "cache served (whole blocks).", labels=["replica"]),
            "running": GaugeMetricFamily("kiln:replica_num_requests_running", "Sequences the replica steps.",
                                         labels=["replica"]),
            "waiting": GaugeMetricFamily("kiln:replica_num_requests_waiting", "Sequences waiting on the replica.",
                                         labels=["replica"]),
        }
        for r in self.router.replicas:
            s, label = r.engine.stats, [r.name]
            families["up"].add_metric(label, 1.0 if r.engine.is_running else 0.0)
            families["routed"].add_metric(label, r.num_routed)
            families["matched"].add_metric(label, r.num_matched_blocks * bs)
            families["queries"].add_metric(label, s.prefix_cache_queries * bs)
            families["hits"].add_metric(label, s.prefix_cache_hits * bs)
            families["running"].add_metric(label, s.num_requests_running)
            families["waiting"].add_metric(label, s.num_requests_waiting)
        yield from families.values()


# set by a torchrun-style launch: then this process is one rank of a mesh, not the owner of several replicas
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def replica_env(k: int, ranks: int, device: str) -> dict[str, str] | None:
    """Replica k's environment: on CUDA, its own `ranks` GPUs (CUDA_VISIBLE_DEVICES: the k-th group of the
    visible ones); on the CPU, this process's."""
    if device != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(ranks * (k + 1))]
    mine = devices[k * ranks:(k + 1) * ranks]
    if len(mine) < ranks:
        raise KilnRuntimeError(f"replica {k} needs {ranks} GPU(s) but only {len(devices)} are visible for all "
                               f"replicas (CUDA_VISIBLE_DEVICES={visible!r})")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def start_replicas(stack: contextlib.ExitStack, config, num_replicas: int, disaggregate: dict | None = None, *,
                   heartbeat_timeout: float = 10.0, **router_kw: Any) -> ReplicaRouter:
    """`kiln serve --data-parallel-size N` (or `--replicas N`): starts N replicas under `stack` (each a core with
    `config` plus the kv-events plugin — for a parallel artifact the rank 0 of its own mesh, on CUDA on its own
    GPUs — or with `disaggregate` a prefill + decode pair; each replica pinned to a disjoint slice of `config.cpus`,
    else of the CPUs this process may use, its threads that slice's share unless `config.num_threads` is set) and
    returns the router over them (started by the server's lifespan)."""
    from ..ipc.client import CoreProcess
    from ..manifest import read_manifest

    if num_replicas < 1:
        raise KilnRuntimeError(f"--data-parallel-size must be at least 1, got {num_replicas}")
    if any(v in os.environ for v in LAUNCHER_ENV):
        raise KilnRuntimeError("--data-parallel-size starts each replica's ranks itself; it cannot run under a "
                               f"torchrun-style launch ({', '.join(v for v in LAUNCHER_ENV if v in os.environ)} set)")
    manifest = read_manifest(config.artifact)
    ranks = int((manifest.get("parallel") or {}).get("world_size", 1))
    cores_per_replica = 1 if disaggregate is None else 1 + int(disaggregate.get("prefill", 1))
    cpus = config.cpus or threads.allowed_cpus()
    slices = threads.split_cpus(cpus, num_replicas)  # each replica its own CPUs (None: fewer CPUs than replicas)
    num_threads = config.num_threads or max(1, len(cpus) // (num_replicas * cores_per_replica))
    engines: list[AsyncLLMEngine] = []
    # One after the other, from this thread: a core dies with the thread that started it (PR_SET_PDEATHSIG).
    for k in range(num_replicas):
        cfg = msgspec.structs.replace(config, num_threads=num_threads, input_address="",
                                      cpus=slices[k] if slices else config.cpus, plugins=[*config.plugins, KV_EVENTS_PLUGIN])
        if disaggregate is None:
            core = CoreProcess.start(cfg, env=replica_env(k, ranks, manifest["device"]))
            engines.append(AsyncLLMEngine.from_process(stack.enter_context(core),
                                                       heartbeat_timeout=heartbeat_timeout))
        else:
            from .service import start_disaggregated
            engines.append(start_disaggregated(stack, cfg, disaggregate, heartbeat_timeout=heartbeat_timeout))
    return ReplicaRouter(engines, **router_kw)
