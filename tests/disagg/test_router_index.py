"""The KV-aware router's parts without processes: the prefix cache's events (what a replica reports), a replica's
index (reported and predicted blocks), and the choice among replicas (longest cached prefix against load, ties
round robin, a dead or overloaded replica passed over)."""
from __future__ import annotations

import asyncio

import pytest
from kiln.runtime.api.async_engine import EngineOverloadedError, PromptInput, RequestGroup, RequestObserver
from kiln.runtime.block_hash import block_hashes
from kiln.runtime.core.prefix_cache import PrefixCache
from kiln.runtime.disagg.router import Load, ReplicaIndex, ReplicaRouter
from kiln.runtime.errors import RequestError
from kiln.runtime.ipc.protocol import CoreStats, RequestLimits
from kiln.runtime.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=4)


def test_prefix_cache_events_follow_inserts_evictions_and_resets():
    cache = PrefixCache()
    cache.insert(11, 0)  # before anyone follows: not recorded
    cache.record_events()
    assert cache.take_events() == []
    cache.insert(12, 1)
    cache.insert(12, 2)  # the same content again: not published twice
    cache.release(0)
    cache.release(1)
    assert cache.evict() == 0
    cache.insert(13, 0)
    assert cache.take_events() == [(True, 12), (False, 11), (True, 13)]
    assert cache.take_events() == []
    assert sorted(cache.cached_hashes()) == [12, 13]
    cache.insert(14, 3)
    cache.reset()
    assert cache.take_events() is None  # the follower must re-read everything
    cache.insert(15, 4)
    assert cache.take_events() == [(True, 15)] and cache.cached_hashes() == [15]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_replica_index_reported_predicted_and_expiry():
    clock = Clock()
    index = ReplicaIndex(predict_ttl=5.0, clock=clock)
    index.apply({"full": [1, 2]})
    assert index.match([1, 2, 3]) == 2 and index.match([2, 1]) == 2 and index.match([9, 1]) == 0
    index.predict([1, 2, 3, 4])
    assert index.predicted == {3: 105.0, 4: 105.0}  # only what is not reported already
    assert index.match([1, 2, 3, 4, 5]) == 4
    index.apply({"events": [(True, 3), (False, 2), (True, 2), (False, 1)]})  # in order: 2 gone, then back
    assert index.reported == {2, 3} and index.predicted == {4: 105.0}
    assert index.match([1, 2]) == 0 and index.match([2, 3, 4]) == 3
    clock.now = 106.0  # a prediction not confirmed in time is forgotten
    assert index.match([2, 3, 4]) == 2
    index.expire()
    assert index.predicted == {}
    index.apply({"full": []})
    assert index.match([2]) == 0


class FakeEngine:
    """What the router uses of an AsyncLLMEngine; `add_requests` records and returns a real RequestGroup."""

    def __init__(self, name: str, refuse: type[Exception] | None = None) -> None:
        self.name = name
        self.info = type("Info", (), {"limits": RequestLimits(1000, 512, BS, 64)})()
        self.tokenizer = None
        self.max_waiting = 1024
        self.observer = RequestObserver()
        self.stats = CoreStats(num_requests_running=1, prefix_cache_hits=2, kv_cache_usage=0.5)
        self.loop = None
        self.running = True
        self.refuse = refuse
        self.added: list[list[int]] = []
        self.aborted: list[str] = []
        self.on_dead: list = []

    @property
    def is_running(self) -> bool:
        return self.running

    async def add_requests(self, inputs, params, lora_name=None) -> RequestGroup:
        if self.refuse is not None:
            raise self.refuse(f"{self.name} refuses")
        self.added.extend(p.prompt_token_ids for p in inputs)
        return RequestGroup(self, inputs, params)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def check_admissible(self, num_prompts, params) -> None:
        pass


def route(router: ReplicaRouter, prompt: list[int], request_id: str) -> tuple[str, RequestGroup]:
    group = asyncio.run(router.add_requests([PromptInput(request_id, prompt)], PARAMS))
    return router.routed[request_id], group


def prefix(n_blocks: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 7) % 997 + 3 for i in range(n_blocks * BS)]


def test_longest_cached_prefix_wins_then_load_spills_over():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b])
    shared = prefix(16, 1)
    router.replicas[1].index.apply({"full": block_hashes(shared, BS, [])})  # b reported the shared prefix
    name, g0 = route(router, shared + [5, 6], "r0")
    assert name == "1" and b.added == [shared + [5, 6]]
    # while r0 runs, requests sharing the prefix still go to b: each adds one uncached block or two there
    groups = [route(router, shared + [i, 7, 8], f"s{i}") for i in range(3)]
    assert [n for n, _ in groups] == ["1"] * 3
    # an unrelated prompt: a costs its prompt; b costs its prompt plus its queued prefills, so a
    assert route(router, prefix(4, 2), "u0")[0] == "0"
    # b loaded with many requests of its own (a refused them meanwhile): the shared prefix spills over to a
    a.refuse = EngineOverloadedError
    for i in range(12):
        route(router, prefix(4, 10 + i), f"load{i}")
    a.refuse = None
    loads = {r.name: r.load() for r in router.replicas}
    assert loads["1"].queued > 16 * BS + loads["0"].queued, loads
    assert route(router, shared + [9], "spill")[0] == "0"
    # finished requests free their replica's load
    for _, g in [("", g0), *groups]:
        g.unfinished.clear()
    assert router.replicas[1].load().requests == loads["1"].requests - 4


def test_the_cost_is_the_estimated_time_to_first_token():
    """A prefix hit is worth the prefill it saves and no more: the replica holding a chat's prefix loses to an idle
    one when the prefills queued there take longer than the hit saves; requests already decoding are not queued
    prefill work; and a replica measured slow (tokens it had to compute per second of time to first token) costs
    more for the same work."""
    clock = Clock()
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b], clock=clock)
    chat = prefix(28, 7)  # 112 tokens, cached on a
    router.replicas[0].index.apply({"full": block_hashes(chat, BS, [])})
    b.refuse = EngineOverloadedError
    queued = [route(router, prefix(64, 20 + i), f"q{i}")[1] for i in range(2)]  # 2 prefills of 256 tokens on a
    b.refuse = None
    assert router.replicas[0].load() == Load(queued=2 * 256, running=0, requests=2)
    # the next turn: 176 tokens, 64 past a's hit. a: 512 queued + 2 * 64 (its own, and what it delays others);
    # b: 2 * 176
    assert route(router, chat + prefix(16, 8), "t0")[0] == "1"
    # a's two have their first tokens (1 s after they were routed): decoding now, no longer prefill ahead
    clock.now += 1.0
    for i, g in enumerate(queued):
        g.first_token_at[f"q{i}"] = clock.now
    assert router.replicas[0].load() == Load(queued=0, running=2, requests=2)
    # measured by q0 alone (256 tokens in 1 s): q1 had a prefill queued ahead (its time is a's batching)
    assert router.replicas[0].speed == pytest.approx(256.0)
    assert route(router, chat + prefix(16, 9), "t1")[0] == "0"  # a: 2 + 2 * 64 tokens; b: 176 + 2 * 176
    # t0 (too short to measure b) has its first token; then b alone takes 256 tokens and needs 25.7 s for them
    router.replicas[1].groups[0][0].first_token_at["t0"] = clock.now
    assert router.replicas[1].load() == Load(queued=0, running=1, requests=1) and router.replicas[1].speed is None
    a.refuse = EngineOverloadedError
    _, big = route(router, prefix(64, 40), "big")
    a.refuse = None
    clock.now += 25.7
    big.first_token_at["big"] = clock.now
    assert router.replicas[1].load().running == 2 and router.replicas[1].speed == pytest.approx(10.0)
    # a prompt cached nowhere: a has 2 + 64 + 2 * 64 tokens to go at 256 tokens/s, b 2 + 2 * 64 at 10 tokens/s
    assert route(router, prefix(16, 30), "u0")[0] == "0"


def test_predictions_steer_a_burst_before_any_report():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b])
    shared = prefix(16, 3)
    first, g0 = route(router, shared + [1], "b0")
    g0.first_token_at["b0"] = 1.0  # its prefill is done (the prefix computed there), its replica reported nothing
    assert all(route(router, shared + [i + 2], f"b{i + 1}")[0] == first for i in range(4))
    assert router.replicas[int(first)].num_matched_blocks == 4 * 16


def test_ties_round_robin_and_dead_or_overloaded_replicas_are_passed_over():
    a, b, c = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")
    router = ReplicaRouter([a, b, c])
    names = [route(router, [1, 2], f"t{i}")[0] for i in range(3)]  # short prompts, no load difference to speak of
    assert sorted(names) == ["0", "1", "2"], names
    b.running = False
    c.refuse = EngineOverloadedError
    for i in range(4):
        assert route(router, prefix(2, 40 + i), f"d{i}")[0] == "0"
    a.refuse = RequestError  # the client's fault: not retried elsewhere
    with pytest.raises(RequestError):
        route(router, [3, 4, 5], "bad")
    a.running = False
    c.running = False
    with pytest.raises(EngineOverloadedError, match="no replica is running"):
        route(router, [3, 4, 5], "none")


def test_stats_sum_live_replicas_and_observer_reaches_every_replica():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b])
    s = router.stats
    assert s.num_requests_running == 2 and s.prefix_cache_hits == 4 and s.kv_cache_usage == 0.5
    b.running = False
    assert router.stats.num_requests_running == 1 and router.is_running
    observer = RequestObserver()
    router.observer = observer
    assert a.observer is observer and b.observer is observer
    router.abort(["x"])
    assert a.aborted == ["x"] and b.aborted == ["x"]


def test_adapter_requests_route_by_load_only():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b])
    shared = prefix(8, 5)
    router.replicas[0].index.apply({"full": block_hashes(shared, BS, [])})
    asyncio.run(router.add_requests([PromptInput("l0", shared)], PARAMS, lora_name="ad"))
    asyncio.run(router.add_requests([PromptInput("l1", shared)], PARAMS, lora_name="ad"))
    assert {router.routed["l0"], router.routed["l1"]} == {"0", "1"}  # the base model's blocks do not count


def test_round_robin_policy_ignores_cache_and_load():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = ReplicaRouter([a, b], policy="round_robin")
    shared = prefix(8, 6)
    router.replicas[0].index.apply({"full": block_hashes(shared, BS, [])})
    assert [route(router, shared + [i], f"q{i}")[0] for i in range(4)] == ["0", "1", "0", "1"]
    with pytest.raises(Exception, match="router policy 'random'"):
        ReplicaRouter([a], policy="random")


def test_prefix_cache_events_overflow_asks_for_a_snapshot(monkeypatch):
    import kiln.runtime.core.prefix_cache as prefix_cache
    monkeypatch.setattr(prefix_cache, "MAX_EVENTS", 3)
    cache = PrefixCache()
    cache.record_events()
    for i in range(5):  # nobody drains: past the cap the log is dropped and the follower told to re-read
        cache.insert(100 + i, i)
    assert cache.take_events() is None
    assert sorted(cache.cached_hashes()) == [100, 101, 102, 103, 104]
    cache.insert(105, 5)
    assert cache.take_events() == [(True, 105)]


# Starting replicas: each replica's devices, and what is refused before anything starts --------------------------
def test_each_cuda_replica_gets_its_own_group_of_gpus(monkeypatch):
    from kiln.runtime.disagg.router import replica_env
    from kiln.runtime.errors import KilnRuntimeError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [replica_env(k, 2, "cuda")["CUDA_VISIBLE_DEVICES"] for k in (0, 1)] == ["4,5", "6,7"]
    assert replica_env(1, 2, "cpu") is None  # the CPU: this process's environment
    with pytest.raises(KilnRuntimeError, match="replica 2 needs 2 GPU"):
        replica_env(2, 2, "cuda")


@pytest.mark.parametrize("env, replicas, match", [({"RANK": "0", "WORLD_SIZE": "2"}, 2, "torchrun-style launch"),
                                                  ({}, 0, "at least 1")])
def test_replicas_refused_before_any_core_starts(monkeypatch, env, replicas, match):
    import contextlib

    from kiln.runtime.disagg.router import start_replicas
    from kiln.runtime.errors import KilnRuntimeError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with contextlib.ExitStack() as stack, pytest.raises(KilnRuntimeError, match=match):
        start_replicas(stack, None, replicas)  # no config needed: nothing is started
