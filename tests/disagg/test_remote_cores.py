"""Engine cores on "separate machines" (separate processes on localhost, reached over TCP only): `kiln serve ART
--role prefill|decode|both --host H --port P` and `kiln router --prefill URL --decode URL ...` / `--replica URL
...`. Answers equal co-located serving; one prefill core serves two decode cores (transfer ids unique across them,
each decode core's leases its own, all returned); co-located remote replicas are routed by the block hashes they
report; a SIGKILLed decode core fails only its own requests within BOUND_S, a SIGKILLed prefill core fails none
(its decode cores prefill themselves), /health and kiln:router_replica_up say what is left; a prefill and a decode
core of differently compiled artifacts (KV layouts) are refused at router start (exit 2)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import MODEL, LiveServer
from remote_cluster import Cluster, core_utility, spawn

BS = 4  # the stand-in artifact's block size
BOUND_S = 10.0  # heartbeat timeout (2 s, the router's flag here) + a wide margin for a shared machine


def prompts(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, BS, BS + 1, 2 * BS, 2 * BS + 1, 5 * BS, 33, 60, 97]
    return [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def assert_same(got: dict, ref: dict) -> None:
    assert got["text"] == ref["text"]
    a, b = got["logprobs"]["token_logprobs"], ref["logprobs"]["token_logprobs"]
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def metric(url: str, name: str, replica: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf'^{re.escape(name)}{{replica="{replica}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{replica={replica}}} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def colocated(artifact_dir):
    server = LiveServer(artifact_dir, {"num_kv_blocks": 256})
    try:
        return {(tuple(p), n): complete(server.url, p, n) for p in prompts() for n in (8, 120)}
    finally:
        server.stop()


def stream_until_first_token(url: str, prompt: list[int], max_tokens: int):
    """Opens a streamed completion and reads its first chunk; returns (response, line iterator)."""
    client = httpx.Client(timeout=60)
    req = client.build_request("POST", url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and "choices" in line:
            break
    return client, resp, lines


def finish_stream(client, resp, lines) -> tuple[str, float]:
    """Reads a stream to its end: ("ok" (it finished: "length") | "error" | "cut", when it ended)."""
    outcome = "cut"
    try:
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    outcome = "error"
                elif any(c.get("finish_reason") == "length" for c in event.get("choices", [])):
                    outcome = "ok"
    except httpx.HTTPError:
        outcome = "error"
    finally:
        resp.close()
        client.close()
    return outcome, time.monotonic()


def test_disaggregated_remote_cores(artifact_dir, colocated):
    """One prefill core shared by two decode cores behind `kiln router`; then the faults, one at a time."""
    cluster = Cluster()
    try:
        prefill = cluster.core(artifact_dir, "prefill")
        decodes = [cluster.core(artifact_dir, "decode") for _ in range(2)]
        router = cluster.router("--prefill", prefill.url, "--decode", decodes[0].url, "--decode", decodes[1].url,
                                "--remote-prefill", "always")
        assert "kiln router: over 1 prefill and 2 decode engine core(s)" in router.output()
        ps = prompts()
        for p in ps:  # concurrency 1: logprobs as co-located
            assert_same(complete(router.url, p), colocated[(tuple(p), 8)])
        with ThreadPoolExecutor(4) as pool:  # and concurrently
            for p, got in zip(ps, pool.map(lambda p: complete(router.url, p), ps)):
                assert got["text"] == colocated[(tuple(p), 8)]["text"]
        stats = [core_utility(d.url, "disagg_stats") for d in decodes]
        for s in stats:  # each decode core's leases are its own, all returned, every transfer committed
            assert s["leases"] == 0 and s["blocks"]["leased"] == 0 and s["pending"] == 0, s
            assert s["transfers"].get("failed", 0) == 0 and s["bad_frames"] == 0, s
        remote = sum(s["decisions"].get("remote", 0) for s in stats)
        assert all(s["decisions"].get("remote", 0) > 0 for s in stats), stats  # both decode cores took some
        assert sum(s["transfers"]["succeeded"] for s in stats) == remote
        p_stats = core_utility(prefill.url, "disagg_stats")
        assert p_stats["bytes_sent"] == sum(s["bytes_received"] for s in stats) > 0, (p_stats, stats)

        # A decode core SIGKILLed mid-generation: its streams end with an error within BOUND_S, the others finish.
        before = [metric(router.url, "kiln:router_requests_total", str(k)) for k in range(2)]
        rng = random.Random(3)
        with ThreadPoolExecutor(4) as pool:  # 240 tokens each: all four are generating when the kill comes
            streams = list(pool.map(lambda p: stream_until_first_token(router.url, p, 240),
                                    [[rng.randrange(3, 200) for _ in range(5)] for _ in range(4)]))
        routed = [metric(router.url, "kiln:router_requests_total", str(k)) - before[k] for k in range(2)]
        assert routed[0] > 0 and routed[1] > 0, routed  # unrelated prompts spread over both
        os.kill(decodes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        with ThreadPoolExecutor(len(streams)) as pool:
            results = list(pool.map(lambda s: finish_stream(*s), streams))
        assert max(t - killed for _, t in results) < BOUND_S, "a stream outlived its decode core by BOUND_S"
        ends = [outcome for outcome, _ in results]
        # the victim's streams that had not finished fail (never cut off silently); the survivor's finish
        assert 1 <= ends.count("error") <= routed[0] and ends.count("ok") >= routed[1] and "cut" not in ends, ends
        decodes[0].popen.wait(BOUND_S)  # `kiln serve --role` exits with its core ...
        assert decodes[0].popen.returncode == 1
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200  # ... the router serves on
        assert metric(router.url, "kiln:router_replica_up", "0") == 0.0
        assert metric(router.url, "kiln:router_replica_up", "1") == 1.0
        for p in ps[:4]:
            assert_same(complete(router.url, p), colocated[(tuple(p), 8)])

        # The prefill core SIGKILLed: nothing fails; the decode core prefills (after the heartbeat timeout).
        long = ps[-1]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(complete, router.url, long, 120)]
            os.kill(prefill.pid, signal.SIGKILL)
            futures.append(pool.submit(complete, router.url, ps[-2], 120))
            for p, f in zip((long, ps[-2]), futures):
                assert f.result(timeout=60)["text"] == colocated[(tuple(p), 120)]["text"]
        time.sleep(3)  # past the heartbeat timeout: the router knows it is gone
        assert complete(router.url, ps[-3])["text"] == colocated[(tuple(ps[-3]), 8)]["text"]
        s = core_utility(decodes[1].url, "disagg_stats")  # it asserts free + active + leased + cached == total
        assert s["leases"] == 0 and s["blocks"]["leased"] == 0 and s["pending"] == 0, s

        # The last decode core gone: /health turns 503 and the router exits 1.
        os.kill(decodes[1].pid, signal.SIGKILL)
        router.popen.wait(BOUND_S)
        assert router.popen.returncode == 1, router.output()
        assert "every replica is gone" in router.output()
    finally:
        cluster.close()


def test_remote_replicas_route_by_reported_blocks(artifact_dir, colocated):
    """`kiln router --replica URL --replica URL` over two co-located cores (`--role both`): prompts sharing a long
    prefix follow the replica whose prefix cache reported it; answers as co-located."""
    cluster = Cluster()
    try:
        cores = [cluster.core(artifact_dir, "both") for _ in range(2)]
        router = cluster.router("--replica", cores[0].url, "--replica", cores[1].url)
        for p in prompts()[:4]:
            assert_same(complete(router.url, p), colocated[(tuple(p), 8)])
        rng = random.Random(9)
        shared = [rng.randrange(3, 200) for _ in range(12 * BS)]
        sharing = [shared + [rng.randrange(3, 200) for _ in range(3)] for _ in range(4)]
        complete(router.url, sharing[0])
        time.sleep(1.0)  # the holder reports the prefix's blocks (the router drains events every 0.2 s)
        before = [metric(router.url, "kiln:router_requests_total", str(k)) for k in range(2)]
        for p in sharing[1:]:
            complete(router.url, p)
        after = [metric(router.url, "kiln:router_requests_total", str(k)) for k in range(2)]
        assert sorted(a - b for a, b in zip(after, before)) == [0, 3], (before, after)
        holder = str(max(range(2), key=lambda k: after[k] - before[k]))
        assert metric(router.url, "kiln:replica_prefix_cache_hits_total", holder) >= 3 * 12 * BS
    finally:
        cluster.close()


def test_kv_layout_mismatch_is_refused(artifact_dir, tmp_path):
    """A prefill core of an artifact compiled with another KV dtype: `kiln router` exits 2 with both layouts."""
    other = tmp_path / "bf16kv"
    shutil.copytree(artifact_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["kv_cache"]["dtype"] = "bfloat16"
    (other / "manifest.json").write_text(json.dumps(manifest))
    cluster = Cluster()
    try:
        prefill = cluster.core(other, "prefill")
        decode = cluster.core(artifact_dir, "decode")
        router = cluster.router("--prefill", prefill.url, "--decode", decode.url, wait=False)
        assert router.popen.wait(60) == 2, router.output()
        out = router.output()
        assert "different KV layouts" in out and "bfloat16" in out and "float32" in out, out
        assert "Traceback" not in out
        # a core given in the wrong role is refused the same way
        wrong = cluster.router("--prefill", decode.url, "--decode", decode.url, wait=False)
        assert wrong.popen.wait(60) == 2 and "serves the decode role" in wrong.output(), wrong.output()
        nobody = spawn("router", "--replica", "127.0.0.1:9", "--connect-timeout", "2")  # nothing listens there
        cluster.procs.append(nobody)
        assert nobody.popen.wait(60) == 2 and "no engine core answers" in nobody.output(), nobody.output()
    finally:
        cluster.close()


def test_addresses_and_pairing_rules():
    """Without processes: core addresses, and what `kiln router` refuses before it connects anything."""
    from kiln.runtime.disagg.remote import Probed, build_router, check_cores, core_url
    from kiln.runtime.errors import KilnRuntimeError
    from kiln.runtime.ipc.protocol import CoreInfo, RequestLimits

    assert core_url("10.0.0.2:7100") == core_url("tcp://10.0.0.2:7100") == "tcp://10.0.0.2:7100"
    for bad in ("10.0.0.2", "http://10.0.0.2:7100", "h:port"):
        with pytest.raises(KilnRuntimeError, match="not an engine core's address"):
            core_url(bad)
    limits = RequestLimits(vocab_size=100, max_model_len=256, block_size=4, num_blocks=256)

    def core(role, layout=(2, "float32"), endpoint=None, lim=limits):
        info = CoreInfo(protocol_version=4, kiln_version="0", pid=1, artifact="a", input_address="", limits=lim,
                        max_waiting=1, device="cpu", target="cpu", arch=None, served_name=None, tokenizer_dir=None,
                        kv_bytes=0, async_scheduling=False, speculative=None, num_threads=1, max_seqs=8,
                        max_batched_tokens=64)
        lay = None if role == "both" else {"num_layers": layout[0], "dtype": layout[1]}
        return Probed(f"h:{id(info)}", info, role, lay, endpoint)

    check_cores([core("prefill")], [core("decode", endpoint="tcp://h:1"), core("decode")], [])  # pairs
    with pytest.raises(KilnRuntimeError, match="different KV layouts"):
        check_cores([core("prefill", (3, "float32"))], [core("decode")], [])
    with pytest.raises(KilnRuntimeError, match="serves the decode role"):
        check_cores([core("decode")], [core("decode")], [])
    with pytest.raises(KilnRuntimeError, match="serves the prefill role .--role prefill.; give it as --prefill"):
        check_cores([], [], [core("prefill")])
    with pytest.raises(KilnRuntimeError, match="pairs with one prefill core"):
        check_cores([core("prefill"), core("prefill")], [core("decode", endpoint="nixl:abc")], [])
    other = RequestLimits(vocab_size=100, max_model_len=128, block_size=4, num_blocks=256)
    with pytest.raises(KilnRuntimeError, match="different limits"):
        check_cores([], [], [core("both"), core("both", lim=other)])
    for args, message in ((([], [], []), "not both and not neither"), ((["a:1"], ["b:1"], ["c:1"]), "not both"),
                          (([], ["b:1"], []), "needs at least one --prefill"),
                          ((["a:1"], [], []), "needs at least one --decode")):
        with pytest.raises(KilnRuntimeError, match=message):
            build_router(*args)
