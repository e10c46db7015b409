"""Disaggregated serving across processes: the router (the API server's engine) over a prefill and a decode core,
KV over TCP. The OpenAI API answers what a co-located server answers (and a client that disconnects mid-stream leaves no lease or block behind); the prefill core SIGKILLed with transfers in
flight costs no request (they fall back to decode-side prefill within a bound); the decode core SIGKILLed fails
every request within a bound; no process is left behind."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import MODEL, LiveServer
from live_server import pid_alive as alive

BOUND_S = 10.0  # a request's end after a core is killed


def completion(url: str, prompt: list[int], max_tokens: int = 8, timeout: float = 60.0) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True, "logprobs": 1},
                   timeout=timeout)
    return {"status": r.status_code, "body": r.json()}


def prompts(n: int = 12, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 4, 5, 8, 9, 17, 33, 60, 3, 16, 41][:n]
    return [[rng.randrange(3, 200) for _ in range(k)] for k in lengths]


def disagg_stats(server: LiveServer) -> dict:
    return asyncio.run_coroutine_threadsafe(server.engine.call_utility("disagg_stats"), server.engine.loop).result(10)


@pytest.fixture(scope="module")
def colocated(artifact_dir):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256})
    try:
        yield {tuple(p): completion(server.url, p)["body"]["choices"][0] for p in prompts()}
    finally:
        server.stop()


def test_disaggregated_server_answers_like_colocated(artifact_dir, colocated):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256}, disaggregate={"transport": "tcp", "remote_prefill": "always"})
    pids = [server.core.pid, server.prefill_core.pid]
    try:
        ps = prompts()
        with ThreadPoolExecutor(4) as pool:  # concurrent, then each prompt again (a decode-side prefix hit)
            first = list(pool.map(lambda p: completion(server.url, p), ps))
        again = [completion(server.url, p) for p in ps]
        for p, a, b in zip(ps, first, again):
            ref = colocated[tuple(p)]
            for got in (a, b):
                assert got["status"] == 200, got
                assert got["body"]["choices"][0]["text"] == ref["text"], p
            # concurrency 1, prefix hit or not: the same tokens, logprobs within fp32 rounding
            lp, ref_lp = b["body"]["choices"][0]["logprobs"]["token_logprobs"], ref["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(lp, ref_lp)) < 1e-4
        stats = disagg_stats(server)
        assert stats["decisions"]["remote"] >= len(ps) - 1, stats
        assert stats["transfers"]["succeeded"] == stats["decisions"]["remote"], stats
        assert stats["leases"] == 0 and stats["blocks"]["leased"] == 0
        deadline = time.monotonic() + 5
        while server.metric("kiln:kv_transfer_succeeded_total") < stats["transfers"]["succeeded"] or \
                server.metric("kiln:prefill_decisions_total") < sum(stats["decisions"].values()):
            assert time.monotonic() < deadline, "the router's /metrics lag its decode core's counters"
            time.sleep(0.1)
        # streaming: tokens come as the decode core makes them (steps slowed so that deltas the front-end
        # has not yet sent when the next arrives, which it rightly sends as one event, cannot merge them all)
        with server.slow_steps(0.02), httpx.stream(
                "POST", server.url + "/v1/completions", timeout=30,
                json={"model": MODEL, "prompt": ps[7], "max_tokens": 16, "temperature": 0.0,
                      "ignore_eos": True, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) >= 3 and events[-1] == "data: [DONE]"
        streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert streamed == completion(server.url, ps[7], max_tokens=16)["body"]["choices"][0]["text"]
        server.wait_idle()
        # clients that go away after their first token: nothing stays behind on either core
        with server.slow_steps(0.05):
            for p in ps[6:10]:
                with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                                  json={"model": MODEL, "prompt": p, "max_tokens": 200, "temperature": 0.0,
                                        "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break
            deadline = time.monotonic() + BOUND_S
            while disagg_stats(server)["pending"] or server.in_engine(lambda e: e.has_unfinished_requests()):
                assert time.monotonic() < deadline, "aborted requests still in the decode core"
                time.sleep(0.05)
        stats = disagg_stats(server)
        assert stats["leases"] == 0 and stats["blocks"]["leased"] == 0, stats
        server.wait_idle()
        assert server.in_engine(lambda e: e.has_unfinished_requests(), core=server.engine.prefill) is False
    finally:
        server.stop()
    assert not any(alive(pid) for pid in pids), "a core outlived the server"


def test_prefill_killed_mid_transfer_costs_no_request(artifact_dir, colocated):
    # 16 tokens a step: the prefill core works through the prompts over several steps
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256, "max_num_batched_tokens": 16},
                        disaggregate={"transport": "tcp", "remote_prefill": "always"})
    try:
        ps = prompts()
        # the prefill core computes slowly, so some transfers are done, some in flight, some queued when it dies
        with server.slow_steps(0.1, core=server.engine.prefill), ThreadPoolExecutor(len(ps)) as pool:
            futures = [pool.submit(completion, server.url, p) for p in ps]
            deadline = time.monotonic() + 20
            while not disagg_stats(server)["transfers"].get("succeeded"):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert disagg_stats(server)["pending"], "no transfer in flight: the test proves nothing"
            os.kill(server.prefill_core.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        elapsed = time.monotonic() - killed
        assert elapsed < BOUND_S, f"requests ended {elapsed:.1f} s after the prefill core died"
        for p, got in zip(ps, results):
            assert got["status"] == 200, got
            assert got["body"]["choices"][0]["text"] == colocated[tuple(p)]["text"], p
        # the server keeps serving, prefilling on the decode core
        assert completion(server.url, ps[8])["body"]["choices"][0]["text"] == colocated[tuple(ps[8])]["text"]
        assert server.engine.is_running and not server.engine.prefill.is_running
        stats = disagg_stats(server)
        assert stats["leases"] == 0 and stats["pending"] == 0 and stats["blocks"]["leased"] == 0, stats
        server.wait_idle()
    finally:
        server.stop()


def test_decode_killed_fails_every_request_in_bound(artifact_dir):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256}, disaggregate={"transport": "tcp", "remote_prefill": "always"})
    prefill_pid = server.prefill_core.pid
    try:
        ps = prompts()
        with ThreadPoolExecutor(len(ps)) as pool:
            futures = [pool.submit(completion, server.url, p, 64) for p in ps]
            time.sleep(0.2)
            os.kill(server.core.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        assert time.monotonic() - killed < BOUND_S
        assert all(r["status"] in (200, 500, 503) for r in results), results
        assert any(r["status"] != 200 for r in results)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        # the prefill core is left with nothing: its requests ended, every block of it free, its sender not stuck
        server.wait_idle(core=server.engine.prefill)
        assert alive(prefill_pid)
    finally:
        server.stop()
    assert not alive(prefill_pid), "the prefill core outlived the server"


def test_conditional_disaggregation_auto(artifact_dir, colocated):
    """remote_prefill = auto: a prompt whose part past the decode core's prefix-cache hit is short is prefilled on
    the decode core (which measures its prefill speed from them and sets the threshold from it), a long one on
    the prefill core, none remotely while the prefill queue is full; every answer equals co-located serving."""
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256}, disaggregate={
        "transport": "tcp", "remote_prefill": "auto", "max_local_prefill": 8, "local_prefill_budget_s": 1.0})
    router = server.engine
    try:
        ps = prompts()
        long_a, long_b, long_c, short = ps[8], ps[11], ps[7], ps[1]  # 60, 41, 33 and 3 tokens

        def ask(p):
            got = completion(server.url, p)
            assert got["status"] == 200 and got["body"]["choices"][0]["text"] == colocated[tuple(p)]["text"], p
            return disagg_stats(server)["decisions"]

        assert router.local_prefill_threshold == 8  # nothing measured yet: the cold start's max_local_prefill
        assert server.metric('kiln:local_prefill_threshold_tokens{source="default"}') == 8.0
        assert ask(long_a) == {"remote": 1}
        assert ask(short) == {"remote": 1, "local:short_prompt_unmeasured": 1}  # kept local by the default
        assert router.local_prefill_tps is not None and router.local_prefill_threshold >= 4  # >= 4 tokens/s
        # the same long prompt again: the decode core caches all but its last block, so it is short now
        assert ask(long_a)["local:short_prompt"] == 1
        router.max_prefill_queue = 0  # (the router's attribute; read per request on its loop)
        assert ask(long_b)["local:prefill_queue_full"] == 1
        router.max_prefill_queue = 8
        router.local_prefill_tps = 1.0  # a slow decode core (threshold 1 token): long prompts go remote again
        assert ask(long_c)["remote"] == 2
        stats = disagg_stats(server)
        assert stats["transfers"]["succeeded"] == 2 and stats["leases"] == 0 and stats["blocks"]["leased"] == 0
        deadline = time.monotonic() + 5
        while server.metric("kiln:remote_prefill_ttft_seconds_count") < 2 or \
                server.metric("kiln:local_prefill_ttft_seconds_count") < 3 or \
                server.metric("kiln:kv_transfer_seconds_count") < 2:
            assert time.monotonic() < deadline, "per-path TTFT / transfer histograms missing from /metrics"
            time.sleep(0.1)
        assert server.metric('kiln:local_prefill_threshold_tokens{source="measured"}') == 1.0
        server.wait_idle()
    finally:
        server.stop()


def prefill_stats(server: LiveServer, core) -> dict:
    return asyncio.run_coroutine_threadsafe(core.call_utility("disagg_stats"), server.engine.loop).result(10)


def test_two_prefill_cores_share_transfers_and_one_dying_costs_nothing(artifact_dir, colocated):
    # no prefix cache: the same prompts again are whole transfers again; 16 tokens a step: prefills take steps
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256, "max_num_batched_tokens": 16, "prefix_cache": None},
                        disaggregate={"transport": "tcp", "prefill": 2, "remote_prefill": "always"})
    router = server.engine
    try:
        assert len(router.prefills) == 2
        ps = prompts()

        def check(results):
            for p, got in zip(ps, results):
                assert got["status"] == 200, got
                assert got["body"]["choices"][0]["text"] == colocated[tuple(p)]["text"], p

        with ThreadPoolExecutor(len(ps)) as pool:
            check(list(pool.map(lambda p: completion(server.url, p), ps)))
        sent = [prefill_stats(server, core)["counts"].get("sent", 0) for core in router.prefills]
        assert all(sent) and sum(sent) == disagg_stats(server)["transfers"]["succeeded"], sent
        victim = router.prefills[1]
        with server.slow_steps(0.1, core=victim), ThreadPoolExecutor(len(ps)) as pool:
            futures = [pool.submit(completion, server.url, p) for p in ps]
            deadline = time.monotonic() + 20
            while not _computing_on(router, victim):
                assert time.monotonic() < deadline, "no transfer went to the second prefill core"
                time.sleep(0.01)
            os.kill(victim.process.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=60) for f in futures]
        assert time.monotonic() - killed < BOUND_S
        check(results)
        # the survivor takes every remote prefill from now on
        before = prefill_stats(server, router.prefills[0])["counts"].get("sent", 0)
        check([completion(server.url, p) for p in ps])
        assert prefill_stats(server, router.prefills[0])["counts"]["sent"] > before
        assert router.is_running and router.prefills[0].is_running and not victim.is_running
        stats = disagg_stats(server)
        assert stats["leases"] == 0 and stats["pending"] == 0 and stats["blocks"]["leased"] == 0, stats
        server.wait_idle()
    finally:
        server.stop()


def _computing_on(router, core) -> bool:
    """Whether a transfer in flight is `core`'s (read from the test's thread while the router's loop changes it)."""
    try:
        return any(c is core for c in list(router._prefill_of.values()))
    except RuntimeError:  # changed while copied
        return False
