"""The KV-aware router over two replicas (engine cores in their own processes, one thread each) behind one API
server: requests sharing a long prefix go to the replica that caches it (its own prefix-cache counters in /metrics
say so), unrelated concurrent requests spread over both, every answer equals a single core's; a replica SIGKILLed
fails only the requests it held, within a bound, and the router keeps serving on the other; no process is left."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import LiveServer
from live_server import pid_alive as alive
from test_disagg_serve import completion

BS = 4  # the stand-in artifact's block size
BOUND_S = 10.0  # a request's end after its replica was killed


def replica_metric(server: LiveServer, name: str, replica: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf'^{re.escape(name)}{{replica="{replica}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{replica={replica}}} not in /metrics"
    return float(m.group(1))


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def workload(seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """Six prompts sharing a 48-token (12-block) prefix, and eight unrelated ones."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(12 * BS)]
    sharing = [shared + [rng.randrange(3, 200) for _ in range(3)] for _ in range(6)]
    unrelated = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))] for _ in range(8)]
    return sharing, unrelated


@contextlib.contextmanager
def replicas(artifact_dir, **kw):
    """Two replicas behind the router (`kw`: LiveServer's); asserts afterwards that none of its cores is left."""
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256}, replicas=2, **kw)
    pids = [c.pid for c in server.cores] + [r.engine.prefill.process.pid for r in server.engine.replicas
                                            if hasattr(r.engine, "prefills")]
    try:
        yield server, server.engine
    finally:
        server.stop()
    assert not any(alive(pid) for pid in pids), "a core outlived the server"


@pytest.fixture(scope="module")
def single(artifact_dir):
    """Every prompt's answer from one core (8 and 48 tokens)."""
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256})
    try:
        sharing, unrelated = workload()
        return {(tuple(p), n): completion(server.url, p, n)["body"]["choices"][0]["text"]
                for p in sharing + unrelated for n in (8, 48)}
    finally:
        server.stop()


def test_shared_prefix_goes_to_the_replica_holding_it(artifact_dir, single):
    with replicas(artifact_dir) as (server, router):
        if len(os.sched_getaffinity(0)) >= 2:  # each replica computes on CPUs of its own (threads.split_cpus)
            placed = [set(os.sched_getaffinity(core.pid)) for core in server.cores]
            assert [set(core.info.cpus) for core in server.cores] == placed
            assert all(placed) and not placed[0] & placed[1], placed
        sharing, unrelated = workload()
        first = completion(server.url, sharing[0])
        assert first["status"] == 200 and first["body"]["choices"][0]["text"] == single[(tuple(sharing[0]), 8)]
        holder = router.routed[first["body"]["id"] + "-0"]
        other = "1" if holder == "0" else "0"
        # the holder reports the prefix's blocks itself (not only the router's prediction)
        wait_for(lambda: len(router.replicas[int(holder)].index.reported) >= 12, "the replica reported no blocks")
        for p in sharing[1:]:  # one at a time: no load difference, the cached prefix decides
            got = completion(server.url, p)
            assert got["status"] == 200 and got["body"]["choices"][0]["text"] == single[(tuple(p), 8)]
            assert router.routed[got["body"]["id"] + "-0"] == holder
        assert replica_metric(server, "kiln:router_requests_total", holder) == len(sharing)
        assert replica_metric(server, "kiln:router_requests_total", other) == 0
        assert replica_metric(server, "kiln:router_matched_tokens_total", holder) >= 5 * 12 * BS
        # the replica's own counters: each later prompt found its 12 blocks cached there, the other replica none
        wait_for(lambda: replica_metric(server, "kiln:replica_prefix_cache_hits_total", holder) >= 5 * 12 * BS,
                 "the holder's prefix-cache hits did not reach /metrics")
        assert replica_metric(server, "kiln:replica_prefix_cache_hits_total", other) == 0
        assert server.metric("kiln:prefix_cache_hits_total") >= 5 * 12 * BS  # the sum over replicas
        # unrelated prompts at once: both replicas take some, answers unchanged
        with ThreadPoolExecutor(len(unrelated)) as pool:
            results = list(pool.map(lambda p: completion(server.url, p), unrelated))
        for p, got in zip(unrelated, results):
            assert got["status"] == 200 and got["body"]["choices"][0]["text"] == single[(tuple(p), 8)], p
        assert replica_metric(server, "kiln:router_requests_total", other) > 0
        for r in router.replicas:
            server.wait_idle(core=r.engine)
        assert replica_metric(server, "kiln:router_replica_up", "0") == 1.0


def test_killed_replica_fails_only_its_own_requests(artifact_dir, single):
    with replicas(artifact_dir) as (server, router):
        sharing, unrelated = workload()
        completion(server.url, sharing[0])  # some replica caches the shared prefix
        holder = router.routed[next(reversed(router.routed))]
        victim = int(holder)  # kill the one holding it: its prefix must not strand later requests
        slow = [server.slow_steps(0.05, core=r.engine) for r in router.replicas]
        with slow[0], slow[1], ThreadPoolExecutor(len(unrelated)) as pool:
            futures = [pool.submit(completion, server.url, p, 48) for p in unrelated]
            ended: dict[int, float] = {}
            for i, f in enumerate(futures):
                f.add_done_callback(lambda _, i=i: ended.setdefault(i, time.monotonic()))
            wait_for(lambda: len(router.routed) == 1 + len(unrelated), "the requests were not all routed")
            placed = list(router.routed.items())[1:]
            assert {name for _, name in placed} == {"0", "1"}, "one replica holds everything: proves nothing"
            time.sleep(0.3)  # both are generating (48 tokens at >= 50 ms a step)
            os.kill(server.cores[victim].pid, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        on_victim = sum(1 for _, name in placed if name == str(victim))
        failed = [r for r in results if r["status"] != 200]
        assert len(failed) == on_victim, (len(failed), on_victim, results)
        late = max(ended[i] - killed for i, r in enumerate(results) if r["status"] != 200)
        assert late < BOUND_S, f"a request ended {late:.1f} s after its replica died"
        assert all(r["status"] in (500, 503) for r in failed), failed
        for p, got in zip(unrelated, results):
            if got["status"] == 200:  # the survivor's requests: whole and right
                assert got["body"]["choices"][0]["text"] == single[(tuple(p), 48)], p
        # the router keeps serving on the survivor, the dead replica's cached prefix included
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert replica_metric(server, "kiln:router_replica_up", str(victim)) == 0.0
        survivor = router.replicas[1 - victim].engine
        for p in sharing[1:3]:
            got = completion(server.url, p)
            assert got["status"] == 200 and got["body"]["choices"][0]["text"] == single[(tuple(p), 8)]
            assert router.routed[got["body"]["id"] + "-0"] == str(1 - victim)
        server.wait_idle(core=survivor)



def test_disaggregated_replicas(artifact_dir, single):
    """`--replicas 2 --disaggregate`: two prefill + decode pairs behind the router; requests sharing a prefix stay
    on one pair, whose transfers all succeed; answers equal one core's; no process is left."""
    with replicas(artifact_dir, disaggregate={"transport": "tcp", "remote_prefill": "always"}) as (server, router):
        sharing, _ = workload()
        names = set()
        for p in sharing[:3]:
            got = completion(server.url, p)
            assert got["status"] == 200 and got["body"]["choices"][0]["text"] == single[(tuple(p), 8)]
            names.add(router.routed[got["body"]["id"] + "-0"])
        assert len(names) == 1, names
        pair = router.replicas[int(names.pop())].engine
        stats = asyncio.run_coroutine_threadsafe(pair.call_utility("disagg_stats"), router.loop).result(10)
        assert stats["decisions"]["remote"] == 3 and stats["transfers"]["succeeded"] == 3, stats
        assert stats["leases"] == 0 and stats["blocks"]["leased"] == 0, stats
