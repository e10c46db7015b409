"""A live kiln server on 127.0.0.1 (random port, uvicorn in a thread) over the runtime's stand-in artifact."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

MODEL = "standin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(proc: subprocess.Popen, url: str, timeout: float = 60) -> None:
    """Polls `url`/health until it answers 200; fails with the output of a `kiln serve` process that exits first
    (its stdout a pipe) or that is not up within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kiln serve did not come up"
        time.sleep(0.2)


class LiveServer:
    """uvicorn serving `build_app(LLMEngine(artifact, **engine_kwargs), **app_kwargs)` from a daemon thread."""

    def __init__(self, artifact: Path, engine_kwargs: dict | None = None, **app_kwargs: Any) -> None:
        import uvicorn
        from kiln.runtime.engine import LLMEngine
        from kiln.runtime.server import build_app

        self.engine = LLMEngine(artifact, **(engine_kwargs or {}))
        self.app = build_app(self.engine, **app_kwargs)
        self.server_state = self.app.state.server
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                      timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._uvicorn.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)

    def in_engine(self, fn: Callable[[Any], Any], timeout: float = 10) -> Any:
        """Runs `fn(engine)` on the engine thread, between two steps."""
        async_engine = self.server_state.async_engine

        async def call() -> Any:
            return await async_engine.call_in_engine_thread(fn)

        return asyncio.run_coroutine_threadsafe(call(), async_engine._loop).result(timeout)

    def wait_idle(self, timeout: float = 20) -> None:
        """Until the engine holds no request; then asserts every KV block is free and the pool is consistent."""
        deadline = time.monotonic() + timeout
        while True:
            busy = self.in_engine(lambda e: e.has_unfinished_requests())
            if not busy:
                break
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.02)

        def check(engine: Any) -> tuple[int, int, list[int]]:
            bm = engine.block_manager
            bm.check_invariants([])
            return bm.num_free_blocks, bm.num_blocks, [r for r in bm.ref_counts if r]

        free, total, referenced = self.in_engine(check)
        assert referenced == [] and free == total, f"{free}/{total} KV blocks free, refs {referenced}"

    @contextlib.contextmanager
    def slow_steps(self, seconds: float) -> Iterator[None]:
        """Makes every forward step take at least `seconds` (so a test can act mid-generation)."""
        def patch(engine: Any) -> None:
            execute = type(engine.runner).execute

            def slow(batch: Any) -> Any:
                time.sleep(seconds)
                return execute(engine.runner, batch)
            engine.runner.execute = slow

        self.in_engine(patch)
        try:
            yield
        finally:
            self.in_engine(lambda e: e.runner.__dict__.pop("execute", None))

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets) from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total
