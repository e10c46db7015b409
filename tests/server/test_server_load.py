"""Client disconnects, metrics, and a bounded concurrent load: afterwards every KV block is free."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from live_server import MODEL

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_blocks(live_server):
    live_server.wait_idle()
    generated = live_server.metric("kiln:generation_tokens_total")
    succeeded = live_server.metric("kiln:request_success_total")
    with live_server.slow_steps(0.01), httpx.stream("POST", live_server.url + "/v1/completions",
                                                      json={**LONG, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert live_server.in_engine(lambda e: len(e.requests)) == 1
    # The connection is closed: the server notices, aborts the request and frees its blocks.
    live_server.wait_idle()
    assert live_server.metric("kiln:generation_tokens_total") - generated < 200
    assert live_server.metric("kiln:request_success_total") == succeeded


def test_non_stream_disconnect_aborts(live_server):
    live_server.wait_idle()
    generated = live_server.metric("kiln:generation_tokens_total")
    with live_server.slow_steps(0.01), pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=LONG, timeout=0.3)
    live_server.wait_idle()
    assert live_server.metric("kiln:generation_tokens_total") - generated < 200


def test_metrics_after_shared_prefix_workload(live_server):
    live_server.wait_idle()
    before = {name: live_server.metric(name) for name in (
        "kiln:time_to_first_token_seconds_count", "kiln:prefix_cache_queries_total", "kiln:prefix_cache_hits_total",
        "kiln:e2e_request_latency_seconds_count", "kiln:request_queue_time_seconds_count",
        "kiln:request_success_total", "kiln:prompt_tokens_total", "kiln:generation_tokens_total")}
    shared = "Paged attention stores keys and values in fixed size blocks. " * 3
    for suffix in ("The quick brown fox", "Once upon a time", "héllo wörld"):
        r = httpx.post(live_server.url + "/v1/completions",
                       json={"model": MODEL, "prompt": shared + suffix, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
    text = httpx.get(live_server.url + "/metrics").text
    for name in ("kiln:inter_token_latency_seconds_bucket", "kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:kv_cache_usage_perc", "kiln:num_preemptions_total"):
        assert name in text
    after = {name: live_server.metric(name) for name in before}
    grew = {name: after[name] - before[name] for name in before}
    assert grew["kiln:time_to_first_token_seconds_count"] == 3
    assert grew["kiln:e2e_request_latency_seconds_count"] == 3
    assert grew["kiln:request_queue_time_seconds_count"] == 3
    assert grew["kiln:request_success_total"] == 3
    assert grew["kiln:generation_tokens_total"] == 12 and grew["kiln:prompt_tokens_total"] > 3 * 30
    # Requests 2 and 3 find the shared prefix (dozens of tokens) in the cache.
    assert grew["kiln:prefix_cache_queries_total"] > 0
    assert grew["kiln:prefix_cache_hits_total"] >= 2 * 32


def test_concurrent_streams_with_early_disconnects(live_server):
    live_server.wait_idle()
    rng = random.Random(0)
    prompts = ["The quick brown fox", "Once upon a time there was", "Paged attention", "héllo wörld", "日本語"]
    num_requests = 150

    async def one(http: httpx.AsyncClient, i: int) -> str:
        chat = i % 2 == 0
        body = {"model": MODEL, "max_tokens": rng.randint(4, 16), "stream": True, "temperature": 1.0, "seed": i}
        if chat:
            body["messages"] = [{"role": "user", "content": prompts[i % len(prompts)]}]
        else:
            body["prompt"] = prompts[i % len(prompts)]
        leave_after = rng.randint(1, 3) if i % 3 == 0 else None  # a third of the clients hang up early
        async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done"
                assert "error" not in json.loads(line[6:])
                events += 1
                if leave_after is not None and events >= leave_after:
                    return "left"
        return "truncated"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=20)
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(num_requests))), 60)

    start = time.monotonic()
    results = asyncio.run(run())
    # A lagging stream gets the steps that waited merged into one event, so a leaver may see its whole answer
    # (and [DONE]) in fewer events than it meant to wait for; everyone else reads to the end.
    stayers = [r for i, r in enumerate(results) if i % 3]
    leavers = [r for i, r in enumerate(results) if i % 3 == 0]
    assert stayers == ["done"] * len(stayers)
    assert set(leavers) <= {"left", "done"} and leavers.count("left") >= len(leavers) // 2, leavers
    live_server.wait_idle(timeout=30)
    assert httpx.get(live_server.url + "/health").status_code == 200
    assert time.monotonic() - start < 60


def test_disconnect_while_queued_is_noticed_without_output(make_server):
    # One sequence at a time: the second request waits in the queue and writes nothing until the first is done.
    server = make_server({"max_num_seqs": 1}, served_model_name="one-at-a-time")
    body = {**LONG, "model": "one-at-a-time", "stream": True}
    with server.slow_steps(0.01), httpx.stream("POST", server.url + "/v1/completions", json=body,
                                               timeout=30) as first:
        assert first.status_code == 200
        with pytest.raises(httpx.ReadTimeout), httpx.stream(
                "POST", server.url + "/v1/completions", json=body, timeout=0.3) as second:
            second.read()
        deadline = time.monotonic() + 1.5  # well before the first request's 200 tokens are done
        while server.in_engine(lambda e: len(e.requests)) != 1:
            assert time.monotonic() < deadline, "the queued request was not aborted"
            time.sleep(0.02)
    server.wait_idle()
