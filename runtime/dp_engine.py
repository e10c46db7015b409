"""Data-parallel replicas: one API server over D engine cores serving the same artifact.

Each replica is a whole engine core process with its own scheduler, KV pool and, for a parallel artifact, its
own mesh of rank workers (a TP=2 artifact served with `--data-parallel-size 2` runs 2 x 2 ranks: two cores,
each the rank 0 of its mesh with one worker). The server talks to one `DataParallelEngine`; each request group
(one API call) goes whole to one replica — the running replica with the fewest requests in flight, ties taken
in turn — and stays there: its deltas, aborts and failure are that replica's `AsyncLLMEngine`'s.

A replica whose core or rank dies fails its own requests (its AsyncLLMEngine's error path, within the mesh
timeout) and takes no new ones; the others go on serving. Only when every replica is gone is the engine dead
(`on_dead`: `kiln serve` exits non-zero). /health stays 200 while one replica runs; `/metrics` has
`kiln:dp_replicas{state}` and `kiln:dp_replica_requests_total{replica}`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from .async_engine import AsyncLLMEngine, EngineOverloadedError, PromptInput, RequestGroup, RequestObserver
from .core_protocol import CoreConfig, CoreInfo, CoreStats
from .errors import KilnRuntimeError
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# set by a torchrun-style launch: then this process is one rank of a mesh, not the owner of several
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class DataParallelEngine:
    """The server's engine over `replicas` (AsyncLLMEngines of cores serving one artifact): the interface of
    AsyncLLMEngine that the server uses (info, tokenizer, stats, observer, add_requests, call_utility, liveness)."""

    def __init__(self, replicas: list[AsyncLLMEngine]) -> None:
        if not replicas:
            raise KilnRuntimeError("a data-parallel engine needs at least one replica")
        self.replicas = replicas
        self.info: CoreInfo = replicas[0].info
        self.tokenizer = replicas[0].tokenizer
        self.dead: str | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self.added = [0] * len(replicas)  # request groups sent to each replica
        self._next = 0  # the replica that wins the next tie
        self._observer: RequestObserver = RequestObserver()

    @property
    def max_waiting(self) -> int:
        return self.replicas[0].max_waiting  # a request group goes whole to one replica

    @property
    def observer(self) -> RequestObserver:
        return self._observer

    @observer.setter
    def observer(self, observer: RequestObserver) -> None:
        self._observer = observer
        for r in self.replicas:
            r.observer = observer

    @property
    def stats(self) -> CoreStats:
        """The replicas' counters summed (the KV usage: their mean), over those running."""
        live = [r.stats for r in self.replicas if r.is_running] or [CoreStats()]
        fields = CoreStats.__struct_fields__
        total = CoreStats(**{f: sum(getattr(s, f) for s in live) for f in fields})
        total.kv_cache_usage = sum(s.kv_cache_usage for s in live) / len(live)
        return total

    @property
    def metrics_collectors(self) -> list:
        return [_ReplicaCollector(self)]

    # Lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        for k, r in enumerate(self.replicas):
            await r.start()
            r.on_dead.append(lambda why, k=k: self._replica_died(k, why))
        self.info = self.replicas[0].info

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()

    @property
    def is_running(self) -> bool:
        return self.dead is None and any(r.is_running for r in self.replicas)

    def _replica_died(self, k: int, why: str) -> None:
        alive = sum(r.is_running for r in self.replicas)
        logger.error("data-parallel replica %d is gone (%s); %d of %d replica(s) still serve", k, why, alive,
                     len(self.replicas))
        if alive == 0 and self.dead is None:
            self.dead = f"every data-parallel replica is gone (the last: replica {k}, {why})"
            for callback in self.on_dead:
                callback(self.dead)

    # Requests ---------------------------------------------------------------------------------------------
    def check_admissible(self, num_prompts: int, params: SamplingParams) -> None:
        self.replicas[0].check_admissible(num_prompts, params)

    def pick(self) -> int:
        """The running replica with the fewest requests in flight; ties go round-robin."""
        n = len(self.replicas)
        live = [k for k, r in enumerate(self.replicas) if r.is_running]
        if not live:
            raise EngineOverloadedError(f"no data-parallel replica is running ({self.dead or 'not started'})")
        k = min(live, key=lambda k: (len(self.replicas[k].processor.requests), (k - self._next) % n))
        self._next = (k + 1) % n
        return k

    async def add_requests(self, inputs: list[PromptInput], params: SamplingParams,
                           lora_name: str | None = None) -> RequestGroup:
        k = self.pick()
        group = await self.replicas[k].add_requests(inputs, params, lora_name)
        self.added[k] += 1
        return group

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Runs the utility on every running replica (a LoRA adapter is loaded into each); returns the first
        replica's answer."""
        live = [r for r in self.replicas if r.is_running]
        if not live:
            raise EngineOverloadedError(f"no data-parallel replica is running ({self.dead or 'not started'})")
        results = [await r.call_utility(method, *args, timeout=timeout) for r in live]
        return results[0]


class _ReplicaCollector:
    """kiln:dp_replicas{state=running|dead}, kiln:dp_replica_requests_total{replica}."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        running = sum(r.is_running for r in self.engine.replicas)
        family = GaugeMetricFamily("kiln:dp_replicas", "Data-parallel replicas (engine cores) by state.",
                                   labels=["state"])
        family.add_metric(["running"], running)
        family.add_metric(["dead"], len(self.engine.replicas) - running)
        yield family
        family = CounterMetricFamily("kiln:dp_replica_requests", "Request groups sent to each data-parallel replica.",
                                     labels=["replica"])
        for k, n in enumerate(self.engine.added):
            family.add_metric([str(k)], n)
        yield family


def replica_env(k: int, ranks: int, device: str) -> dict[str, str] | None:
    """Replica k's environment: on CUDA, its own `ranks` GPUs (CUDA_VISIBLE_DEVICES: the k-th group of the
    visible ones); on the CPU, this process's."""
    if device != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(ranks * (k + 1))]
    mine = devices[k * ranks:(k + 1) * ranks]
    if len(mine) < ranks:
        raise KilnRuntimeError(f"data-parallel replica {k} needs {ranks} GPU(s) but only {len(devices)} are "
                               f"visible for all replicas (CUDA_VISIBLE_DEVICES={visible!r})")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def start_data_parallel(stack, config: CoreConfig, size: int, *, heartbeat_timeout: float = 10.0
                        ) -> DataParallelEngine:
    """`kiln serve --data-parallel-size N`: starts N engine cores serving `config.artifact` under `stack` (the
    CPUs this process may use split between them unless `config.num_threads` is set; on CUDA each replica on its
    own GPUs) and returns the engine over them (started by the server's lifespan)."""
    from .artifact import open_tokenizer, read_manifest
    from .core_client import CoreProcess

    if size < 1:
        raise KilnRuntimeError(f"--data-parallel-size must be at least 1, got {size}")
    if any(v in os.environ for v in LAUNCHER_ENV):
        raise KilnRuntimeError("--data-parallel-size starts each replica's ranks itself; it cannot run under a "
                               f"torchrun-style launch ({', '.join(v for v in LAUNCHER_ENV if v in os.environ)} set)")
    manifest = read_manifest(config.artifact)
    ranks = int((manifest.get("parallel") or {}).get("world_size", 1))
    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // size)
    cores = []
    # One after the other, from this thread: a core dies with the thread that started it (PR_SET_PDEATHSIG)
    for k in range(size):
        cfg = msgspec.structs.replace(config, num_threads=threads, input_address="")
        cores.append(stack.enter_context(CoreProcess.start(cfg, env=replica_env(k, ranks, manifest["device"]))))
    info = cores[0].info
    tokenizer = open_tokenizer(info.tokenizer_dir, info.limits.vocab_size) if info.tokenizer_dir else None
    return DataParallelEngine([AsyncLLMEngine(c.info, tokenizer, process=c, client_name=f"api-dp{k}",
                                              heartbeat_timeout=heartbeat_timeout) for k, c in enumerate(cores)])


__all__ = ["DataParallelEngine", "start_data_parallel"]
