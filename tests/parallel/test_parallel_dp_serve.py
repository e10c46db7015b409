"""`kiln serve --data-parallel-size 2` on a TP=2 artifact: two replicas (engine cores), each the rank 0 of its
own gloo mesh with one worker process: 2 x 2 ranks behind one server.

Its answers equal the single-device artifact's, whichever replica served them; killing one replica's rank fails
that replica's request within 10 s while the other replica's request finishes, and the server goes on serving
on the survivor. Everything started is stopped in `finally`."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import child_pids, free_port, pid_alive, stop_and_reap, wait_serving  # noqa: E402

PROMPTS = [[7, 8, 9, 10, 11], list(range(40, 57))]


def _complete(url: str, prompt: list[int], max_tokens: int, out: dict, key: str) -> None:
    try:
        out[key] = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    except httpx.HTTPError as e:
        out[key] = e
    out[key + "_at"] = time.monotonic()


def test_dp2_x_tp2_server_matches_single_device_and_survives_a_replica(compile_parallel):
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", "tp = 2")
    params = kiln.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with kiln.LLM(str(single), num_kv_blocks=64) as llm:
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(art), "--port", str(port),
                             "--served-model-name", "tiny", "--num-kv-blocks", "64", "--log-level", "warning",
                             "--data-parallel-size", "2", "--num-threads", "1",
                             # requests alternate between the replicas, so one long request runs on each (the kv
                             # policy may send both prompts to the replica that cached them: tests/disagg cover it)
                             "--router-policy", "round_robin"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "KILN_DIST_TIMEOUT": "5"})
    procs: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url, timeout=180)
        cores = child_pids(proc.pid)
        assert len(cores) == 2, cores  # one engine core per replica, each its mesh's rank 0
        workers = {core: child_pids(core) for core in cores}
        assert all(len(w) == 1 for w in workers.values()), workers  # and each its own rank 1
        procs = cores + [w[0] for w in workers.values()]

        # two prompts, twice each, at once: both replicas serve, every answer is the single device's
        results: dict[str, object] = {}
        threads = [threading.Thread(target=_complete, args=(url, PROMPTS[i % 2], 16, results, str(i)))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(4):
            r = results[str(i)]
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            assert r.json()["choices"][0]["text"] == want[i % 2]
        metrics = httpx.get(url + "/metrics").text
        served = [float(v) for v in re.findall(r'^kiln:router_requests_total\{replica="\d"\} (\S+)$', metrics, re.M)]
        assert len(served) == 2 and sum(served) == 4 and min(served) >= 1, metrics

        # one long request on each replica, then one replica's rank 1 dies
        results.clear()
        threads = [threading.Thread(target=_complete, args=(url, PROMPTS[i], 400, results, str(i))) for i in (0, 1)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not re.search(r"^kiln:num_requests_running\S* 2(\.0)?$", httpx.get(url + "/metrics").text, re.M):
            assert time.monotonic() < deadline, "the two requests never ran at once"
            time.sleep(0.05)
        victim = cores[1]
        os.kill(workers[victim][0], signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        statuses = sorted(results[k].status_code for k in ("0", "1"))
        assert statuses == [200, 500], [results[k] for k in ("0", "1")]
        failed = next(k for k in ("0", "1") if results[k].status_code == 500)
        assert "ranks cannot run" in results[failed].json()["error"]["message"]
        assert results[failed + "_at"] - killed < 10  # the server is its own process; 5 s mesh timeout
        finished = next(results[k] for k in ("0", "1") if results[k].status_code == 200)
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 20
        while pid_alive(victim):  # the replica's core exits 1 after failing its requests
            assert time.monotonic() < deadline, "the failed replica's core did not exit"
            time.sleep(0.1)

        # the survivor goes on serving
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]
        metrics = httpx.get(url + "/metrics").text
        up = [float(v) for v in re.findall(r'^kiln:router_replica_up\{replica="\d"\} (\S+)$', metrics, re.M)]
        assert sorted(up) == [0.0, 1.0], metrics
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) in (0, 130)  # stopped by the user (uvicorn re-raises the SIGINT it handled), not 1
        assert "exiting: the engine core is gone" not in proc.stdout.read().decode()
    finally:
        gone = stop_and_reap(proc, procs)
    assert gone
