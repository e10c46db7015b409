"""Output identity across processes, per KV transport (TCP, NIXL): 200 prompts (below one block, exactly k blocks,
k blocks + 1, long; each followed by itself extended, so the decode core's prefix cache covers their front)
through `kiln router` over a prefill core and a decode core (`kiln serve --role`, separate processes, one thread
each), greedy fp32 at concurrency 1: the token ids equal co-located serving's and the logprobs agree within fp32
rounding (1e-5: the decode core computes the last prompt token in a forward of its own, co-located serving in the
prompt's); every transfer commits (none falls back), no lease is left. The processes start once per transport."""
from __future__ import annotations

import json
import random
import shutil

import httpx
import pytest
from live_server import MODEL, LiveServer
from remote_cluster import Cluster, core_utility

BS = 4  # the stand-in artifact's block size
MAX_TOKENS = 4


def workload(seed: int = 21) -> list[list[int]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 200) for _ in range(n)]  # noqa: E731
    base = ([tok(rng.randrange(1, BS)) for _ in range(25)]  # below one block
            + [tok(BS * rng.randrange(1, 12)) for _ in range(25)]  # exactly k blocks
            + [tok(BS * rng.randrange(1, 12) + 1) for _ in range(25)]  # k blocks + 1
            + [tok(rng.randrange(60, 200)) for _ in range(25)])  # long
    # each followed by itself extended: a decode-side prefix hit when len(p) >= BS (right after, before eviction)
    return [q for p in base for q in (p, p + tok(rng.randrange(1, 2 * BS)))]


def complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0.0, "ignore_eos": True, "logprobs": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def bare(artifact_dir, tmp_path_factory):
    """The stand-in artifact without its tokenizer: the server answers token ids."""
    path = tmp_path_factory.mktemp("remote-identity") / "standin"  # the served name: the directory's
    shutil.copytree(artifact_dir, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tokenizer"] = None
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def reference(bare):
    server = LiveServer(bare, {"num_kv_blocks": 256})
    try:
        return [complete(server.url, p) for p in workload()]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_token_ids_and_logprobs_equal_colocated(bare, reference, cluster, transport):
    if not any(p.url and "prefill" in p.output() for p in cluster.procs):
        cluster.core(bare, "prefill")  # one prefill core serves both decode cores
    prefill = next(p for p in cluster.procs if "prefill engine core" in p.output())
    decode = cluster.core(bare, "decode", "--kv-transport", transport)
    assert f"KV over {transport}" in decode.output()
    router = cluster.router("--prefill", prefill.url, "--decode", decode.url, "--remote-prefill", "always")
    ps = workload()
    for i, p in enumerate(ps):
        ids, logprobs = complete(router.url, p)
        ref_ids, ref_logprobs = reference[i]
        assert ids == ref_ids, f"prompt {i} (length {len(p)}): {ids} != co-located {ref_ids}"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-5, (i, logprobs)
    s = core_utility(decode.url, "disagg_stats")
    # every prompt went remote but those with nothing to send (one token, or all but the last cached here)
    remote = s["decisions"]["remote"]
    assert remote + s["decisions"].get("local:nothing_to_transfer", 0) == len(ps) and remote >= 150, s
    assert s["transfers"]["succeeded"] == remote, s
    assert s["transfers"].get("failed", 0) == 0 and s["bad_frames"] == 0 and s["leases"] == 0, s
    stats = core_utility(decode.url, "stats")
    assert stats["prefix_cache_hits"] >= 50, stats  # the extended prompts' fronts came from its prefix cache
    router.popen.terminate()
    router.popen.wait(15)
