"""`kiln serve` on a TP=2 artifact, as a user runs it: a subprocess whose rank 1 is a gloo worker process.

It answers the OpenAI client with the single-device artifact's tokens and logprobs; killing rank 1 fails every
request in flight within 10 s and the server exits with a non-zero status. Everything started is stopped in
`finally`."""
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
import pytest

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import child_pids, free_port, stop_and_reap, wait_serving  # noqa: E402

openai = pytest.importorskip("openai")

PROMPTS = [[7, 8, 9, 10, 11], list(range(40, 57))]


def test_tp2_server_matches_single_device_and_dies_with_its_rank(compile_parallel):
    _, single = compile_parallel("llama", None)
    _, art = compile_parallel("llama", "tp = 2")
    params = kiln.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    with kiln.LLM(str(single), num_kv_blocks=64) as llm:
        want = [o.outputs[0] for o in llm.generate(PROMPTS, params)]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(art), "--port", str(port),
                             "--served-model-name", "tiny", "--num-kv-blocks", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "KILN_DIST_TIMEOUT": "5"})
    workers: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url, timeout=120)
        cores = child_pids(proc.pid)
        assert len(cores) == 1, cores  # the engine core process (rank 0)
        workers = cores + child_pids(cores[0])
        assert len(workers) == 2, workers  # and rank 1's worker process, its child

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, ref in zip(PROMPTS, want, strict=True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0, logprobs=1,
                                          extra_body={"ignore_eos": True})
            choice = r.choices[0]
            assert choice.text == ref.text
            ref_lp = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
            assert choice.logprobs.token_logprobs == pytest.approx(ref_lp, abs=1e-4)

        # two requests in flight (one streaming), then rank 1 dies
        results: dict[str, object] = {}

        def blocking() -> None:
            try:
                results["blocking"] = httpx.post(url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True})
            except httpx.HTTPError as e:
                results["blocking"] = e

        t = threading.Thread(target=blocking)
        t.start()
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "choices" in first
            deadline = time.monotonic() + 30  # both requests running in the core before the rank dies
            while not re.search(r"^kiln:num_requests_running\S* 2(\.0)?$", httpx.get(url + "/metrics").text, re.M):
                assert time.monotonic() < deadline, "the blocking request never started"
                time.sleep(0.05)
            os.kill(workers[1], signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        t.join(30)
        assert time.monotonic() - killed < 10
        assert any('"error"' in line for line in rest), rest[-3:]
        assert not any('"finish_reason":"length"' in line.replace(" ", "") for line in rest)
        blocked = results["blocking"]
        assert isinstance(blocked, httpx.Response) and blocked.status_code == 500, blocked
        assert "ranks cannot run" in blocked.json()["error"]["message"]
        assert proc.wait(20) != 0  # the server stops by itself
        log = proc.stdout.read().decode()
        assert "kiln serve: exiting: the engine core is gone" in log, log[-2000:]  # the core exited 1 after failing them
        assert "the model's ranks cannot run" in log, log[-2000:]
    finally:
        gone = stop_and_reap(proc, workers)
    assert gone
