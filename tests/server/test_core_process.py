"""The engine core in its own process: what its death does to the API server and its clients, and what a step
costs on the wire (per-step deltas, never snapshots)."""
from __future__ import annotations

import asyncio
import json
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
from live_server import MODEL, LiveServer, child_pids, free_port, pid_alive
from live_server import _slow_execute as slow_execute
from standin_artifact import write_artifact

LONG = 2000  # output tokens of the long streams
ERROR_BOUND_S = 5.0


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in model with room for a prompt and LONG output tokens."""
    return write_artifact(tmp_path_factory.mktemp("long-art") / MODEL, max_model_len=LONG + 64)


def _body(max_tokens: int = LONG) -> dict:
    return {"model": MODEL, "prompt": "The quick brown", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def _stream_until_error(url: str, started: asyncio.Event, count: list[int]) -> tuple[str, float]:
    """Streams one completion; returns (how it ended, time.monotonic() then): 'error' (an SSE error event),
    'done' ([DONE] without an error), 'closed' (the connection ended without [DONE])."""
    saw_error = False
    async with httpx.AsyncClient(timeout=60) as http, \
            http.stream("POST", url + "/v1/completions", json=_body()) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return ("error" if saw_error else "done"), time.monotonic()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert "engine core is gone" in chunk["error"]["message"], chunk
                saw_error = True
                continue
            count[0] += 1
            if count[0] == 1:
                started.set()
    return "closed", time.monotonic()


async def _kill_mid_stream(url: str, core_pid: int, clients: int) -> tuple[float, list[tuple[str, float]]]:
    """`clients` streams; once every one has its first chunk, SIGKILLs the core. Returns (kill time, endings)."""
    events = [asyncio.Event() for _ in range(clients)]
    counts = [[0] for _ in range(clients)]
    tasks = [asyncio.ensure_future(_stream_until_error(url, e, c)) for e, c in zip(events, counts)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        endings = await asyncio.wait_for(asyncio.gather(*tasks), ERROR_BOUND_S + 10)
    finally:
        for t in tasks:
            t.cancel()
    assert all(c[0] < LONG for c in counts), "a stream finished before the core was killed"
    return killed, endings


def test_killed_core_fails_every_stream_and_health_turns_503(long_artifact: Path):
    """SIGKILL the engine core while 4 clients stream: each gets an error event within 5 s, /health answers 503
    and new requests 503 (the API server is still up: this server does not exit on its own)."""
    server = LiveServer(long_artifact, {"num_kv_blocks": 4096})
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        server.in_engine(slow_execute, 0.01)  # 2000 tokens take 20 s: every stream is mid-flight when it dies
        killed, endings = asyncio.run(_kill_mid_stream(server.url, server.core.pid, clients=4))
        assert [how for how, _ in endings] == ["error"] * 4
        assert max(t for _, t in endings) - killed < ERROR_BOUND_S
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={**_body(4), "stream": False})
        assert r.status_code == 503 and "engine core" in r.json()["error"]["message"]
        assert server.engine.dead is not None and "SIGKILL" in server.engine.dead
    finally:
        server.stop()


def test_kiln_serve_exits_nonzero_when_its_core_is_killed(long_artifact: Path):
    """`kiln serve` as a user runs it (two processes): SIGKILL its engine core mid-stream; every client gets
    an error within 5 s, the server exits with status 1 and leaves no process behind."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(long_artifact), "--port", str(port),
                             "--num-kv-blocks", "4096", "--num-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    children: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not any(line.startswith("kiln serve:") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        startup = next(line for line in lines if line.startswith("kiln serve:"))
        core_pid = int(re.search(r"engine core pid (\d+)", startup).group(1))
        children = child_pids(proc.pid)
        assert core_pid in children, (core_pid, children)
        killed, endings = asyncio.run(_kill_mid_stream(url, core_pid, clients=4))
        assert [how for how, _ in endings] == ["error"] * 4, endings
        assert max(t for _, t in endings) - killed < ERROR_BOUND_S
        assert proc.wait(15) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
        for pid in children:  # what the test itself must not leave behind either
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    output = "".join(lines)
    assert "the engine core is gone" in output and "SIGKILL" in output, output
    assert "Traceback" not in output, output
    assert [pid for pid in children if pid_alive(pid)] == [], "kiln serve left processes behind"


def test_streaming_sends_deltas_at_2000_tokens(long_artifact: Path, monkeypatch: pytest.MonkeyPatch):
    """One stream of 2000 tokens: the core's message per step and the SSE chunk per step stay the same size
    from the first token to the last (a snapshot of the sequence would grow by every token)."""
    import kiln.runtime.ipc.client as core_client
    from kiln.runtime.ipc.protocol import StepOutputs

    step_bytes: list[int] = []  # each StepOutputs the API server received, in bytes
    decoder = core_client.client_decoder

    class Recording:
        def decode(self, buf):  # noqa: ANN001, ANN202
            msg = decoder.decode(buf)
            if isinstance(msg, StepOutputs) and msg.deltas:
                step_bytes.append(len(buf))
            return msg

    monkeypatch.setattr(core_client, "client_decoder", Recording())
    server = LiveServer(long_artifact, {"num_kv_blocks": 4096})
    try:
        chunk_bytes: list[int] = []  # each SSE event carrying tokens: its bytes less its text's
        texts: list[str] = []
        usage = None
        body = {**_body(), "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:  # the event's bytes but its text's: what a snapshot would grow
                        text = chunk["choices"][0]["text"]
                        chunk_bytes.append(len(line.encode()) - len(json.dumps(text, ensure_ascii=False).encode()))
                        texts.append(text)
                    else:
                        usage = chunk["usage"]
        assert usage["completion_tokens"] == LONG
        assert len(chunk_bytes) > 100  # an event per step with text (fewer when the stream lags: then merged)
        assert len(step_bytes) >= LONG - 1  # one StepOutputs per step (the first may carry the prompt's)
        decode_steps = step_bytes[1:]
        first, last = decode_steps[:200], decode_steps[-200:]
        # What varies in a step's message: the token id and the stats' counters (the stats version, prefix-cache
        # queries: msgpack ints, 1 byte under 128, 3 under 65536) - a few bytes, where a snapshot of the
        # sequence would have grown by 1,800 token ids.
        assert max(last) <= max(first) + 12, (first[:10], last[-10:])
        assert max(decode_steps) < 200
        head, tail = chunk_bytes[1:51], chunk_bytes[-51:-1]  # the last event carries finish_reason
        assert max(tail) <= max(head) and max(chunk_bytes) < 400, (head[:5], tail[-5:])
        nonstream = httpx.post(server.url + "/v1/completions", json={**_body(), "stream": False}, timeout=120)
        assert "".join(texts) == nonstream.json()["choices"][0]["text"]  # the deltas add up to the whole
    finally:
        server.stop()


def test_stream_interval_sends_fewer_larger_deltas_and_the_same_text(long_artifact: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """`--stream-interval 8`: the API server gets a message for a stream every 8 tokens (its first token and its
    end at once), the SSE events carry the same text as the non-streamed answer, token by token in order."""
    import kiln.runtime.ipc.client as core_client
    from kiln.runtime.ipc.protocol import StepOutputs

    tokens_per_message: list[int] = []
    decoder = core_client.client_decoder

    class Recording:
        def decode(self, buf):  # noqa: ANN001, ANN202
            msg = decoder.decode(buf)
            if isinstance(msg, StepOutputs) and msg.deltas:
                tokens_per_message.append(sum(len(d.token_ids) for d in msg.deltas))
            return msg

    monkeypatch.setattr(core_client, "client_decoder", Recording())
    server = LiveServer(long_artifact, {"num_kv_blocks": 256}, stream_interval=8)
    try:
        body = {**_body(61), "stream_options": {"include_usage": True}, "logprobs": 1}
        texts, tokens, usage = [], [], None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        texts.append(chunk["choices"][0]["text"])
                        tokens += chunk["choices"][0]["logprobs"]["tokens"]
                    else:
                        usage = chunk["usage"]
        assert usage["completion_tokens"] == 61
        assert tokens_per_message == [1] + [8] * 7 + [4], tokens_per_message  # first, every 8, the end
        assert len(texts) <= len(tokens_per_message)
        whole = httpx.post(server.url + "/v1/completions", json={**_body(61), "logprobs": 1, "stream": False},
                           timeout=60).json()
        assert "".join(texts) == whole["choices"][0]["text"]
        assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    finally:
        server.stop()
