"""A disaggregated server's counters add up the moment every request has finished: each request one counted
decision (`kiln:prefill_decisions_total`, summed over reasons), each started KV transfer one counted outcome, and
`remote_prefill = always` sends every prompt that has a block past the decode core's prefix-cache hit (issue 29
item 14). `never` is counted too: the router decides it without asking the decode core."""
from __future__ import annotations

import random

import httpx
from live_server import MODEL, LiveServer

OUTCOMES = ("succeeded", "failed", "expired", "aborted")


def complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text


def sixteen_prompts(seed: int = 29) -> list[list[int]]:
    """3..200 tokens; some share a prefix (or are all) of an earlier prompt, so the decode core has hits: three
    of them cover all but the last token (nothing to transfer)."""
    rng = random.Random(seed)
    fresh = lambda k: [rng.randrange(3, 300) for _ in range(k)]  # noqa: E731
    ps = [fresh(k) for k in (3, 200, 17, 40, 9, 65, 16, 120)]
    ps += [ps[1][:150] + fresh(30), ps[3], ps[5][:33], ps[1][:49], ps[7][:64] + fresh(2), ps[7][:17], ps[2] + fresh(1),
           fresh(100)]
    return ps


def blocks_to_send(prompts: list[list[int]], block_size: int) -> list[bool]:
    """Whether each prompt, sent in order, has a block of `[hit, L-1)` to transfer, where the hit is the longest
    run of whole blocks it shares with the prompt of an earlier request (the decode core caches those)."""
    out = []
    for i, p in enumerate(prompts):
        last = len(p) - 1  # the decode core computes the last token itself
        hit = 0
        for q in prompts[:i]:
            k = 0
            while (k + 1) * block_size <= min(last, len(q)) and p[:(k + 1) * block_size] == q[:(k + 1) * block_size]:
                k += 1
            hit = max(hit, k)
        out.append(-(-last // block_size) > hit)
    return out


def counters(url: str) -> tuple[dict[str, float], dict[str, float]]:
    decisions, transfers = {}, {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kiln:prefill_decisions_total{"):
            decisions[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kiln:kv_transfer_") and line.split(" ")[0].endswith("_total"):
            transfers[line.split(" ")[0][len("kiln:kv_transfer_"):-len("_total")]] = float(line.rsplit(" ", 1)[1])
    return decisions, transfers


def test_always_counts_add_up_when_the_last_request_ends(artifact_dir):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 1024},
                        disaggregate={"transport": "tcp", "remote_prefill": "always"})
    try:
        ps = sixteen_prompts()
        block_size = server.engine.info.limits.block_size
        assert min(map(len, ps)) == 3 and max(map(len, ps)) == 200
        expected = blocks_to_send(ps, block_size)
        assert 0 < sum(expected) < len(ps) - 1, "the prompts must test both kinds"
        for i, p in enumerate(ps):
            complete(server.url, p)
            # read right after each request: nothing waits for a heartbeat's snapshot
            decisions, transfers = counters(server.url)
            assert sum(decisions.values()) == i + 1, (i, decisions)
            assert transfers["started"] == sum(transfers[o] for o in OUTCOMES), transfers
        decisions, transfers = counters(server.url)
        assert sum(decisions.values()) == len(ps), decisions
        assert decisions.get("remote", 0) == sum(expected), (decisions, expected)
        assert decisions.get("local:nothing_to_transfer", 0) == len(ps) - sum(expected), decisions
        assert transfers["started"] == transfers["succeeded"] == sum(expected), transfers
        assert transfers["started"] == sum(transfers[o] for o in OUTCOMES), transfers
    finally:
        server.stop()


def test_never_is_counted(artifact_dir):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256}, disaggregate={"transport": "tcp",
                                                                          "remote_prefill": "never"})
    try:
        for p in sixteen_prompts()[:3]:
            complete(server.url, p)
        decisions, transfers = counters(server.url)
        assert decisions == {"local:remote_prefill_never": 3.0}, decisions
        assert transfers["started"] == 0, transfers
    finally:
        server.stop()
