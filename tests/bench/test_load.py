"""500 concurrent streamed requests on a real compiled model, a fifth of the clients hanging up early: the
server finishes in bounded time, every KV block comes back, and /health still answers."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from live_server import LiveServer

NUM_REQUESTS = 500
DISCONNECT_FRACTION = 0.2
TIME_LIMIT_S = 60


@pytest.fixture(scope="module")
def model_server(model_artifact):
    server = LiveServer(model_artifact, {"num_kv_blocks": 2048})
    yield server
    server.stop()


def test_500_concurrent_streams_with_early_disconnects(model_server):
    url = model_server.url
    vocab = model_server.engine.info.limits.vocab_size
    rng = random.Random(0)
    hang_up = set(rng.sample(range(NUM_REQUESTS), int(NUM_REQUESTS * DISCONNECT_FRACTION)))
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(8, 24))] for _ in range(NUM_REQUESTS)]
    max_tokens = [rng.randint(4, 8) for _ in range(NUM_REQUESTS)]
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": model,
                "prompt": prompts[i], "max_tokens": max_tokens[i], "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"http {response.status_code}"
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if i in hang_up:
                    return "hung up"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
                chunk = json.loads(line[6:])
                if chunk.get("usage") and chunk["usage"]["completion_tokens"] != max_tokens[i]:
                    return f"short: {chunk['usage']}"
        return "no [DONE]"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=TIME_LIMIT_S, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(NUM_REQUESTS))),
                                          TIME_LIMIT_S)

    start = time.monotonic()
    outcomes = asyncio.run(run())
    elapsed = time.monotonic() - start
    assert elapsed < TIME_LIMIT_S
    assert outcomes.count("hung up") == len(hang_up)
    assert outcomes.count("done") == NUM_REQUESTS - len(hang_up), sorted(set(outcomes))

    model_server.wait_idle(timeout=30)  # engine side: no request left, every block free, pool consistent
    assert model_server.metric("kiln:kv_cache_usage_perc") == 0
    assert model_server.metric("kiln:num_requests_running") == 0
    assert model_server.metric("kiln:num_requests_waiting") == 0
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompts[0], "max_tokens": 2,
                                                     "ignore_eos": True}).status_code == 200
