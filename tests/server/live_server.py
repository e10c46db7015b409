"""A live kiln server on 127.0.0.1 as `kiln serve` runs it: the engine core in its own process (one thread),
the API server's uvicorn in a daemon thread of the test process, on a random port."""
from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import signal
import socket
import subprocess
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

MODEL = "standin"
HOOKS = str(Path(__file__).with_name("core_hooks.py")) + ":install"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def interrupt(proc: subprocess.Popen, timeout: float = 15) -> None:
    """Stops a `kiln serve` subprocess as a user does (SIGINT), killing it if it has not exited within `timeout`."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_and_reap(proc: subprocess.Popen, pids: list[int], timeout: float = 10) -> bool:
    """Kills `proc` (a `kiln serve` subprocess) if it still runs and every process of `pids` still alive (its engine
    cores, their rank workers); True once all of them are gone within `timeout` seconds."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout)
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, 9)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


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
    """`build_app(AsyncLLMEngine over a CoreProcess(artifact, **engine_kwargs), **app_kwargs)`; `max_waiting` goes
    to the core (it counts the sequences waiting). `replicas` > 1: that many cores behind the KV-aware router."""

    def __init__(self, artifact: Path, engine_kwargs: dict | None = None, *, max_waiting: int = 1024,
                 disaggregate: dict | None = None, replicas: int = 1, stream_interval: int = 1,
                 **app_kwargs: Any) -> None:
        import uvicorn
        from kiln.runtime.api.app import build_app
        from kiln.runtime.api.async_engine import AsyncLLMEngine
        from kiln.runtime.ipc.client import CoreProcess
        from kiln.runtime.ipc.protocol import CoreConfig

        config = CoreConfig(artifact=str(artifact), engine=dict(engine_kwargs or {}), max_waiting=max_waiting,
                            num_threads=1, plugins=[HOOKS], stream_interval=stream_interval)
        self._stack = contextlib.ExitStack()
        try:
            if replicas > 1:  # a KV-aware router over replicas (runtime/disagg/router.py); `cores` in order
                from kiln.runtime.disagg.router import start_replicas
                self.engine = start_replicas(self._stack, config, replicas, disaggregate)
                self.cores = [r.engine.process for r in self.engine.replicas]
            elif disaggregate is None:
                self.core = self._stack.enter_context(CoreProcess.start(config, timeout=60))
                self.engine = AsyncLLMEngine.from_process(self.core)
            else:  # a router over a prefill and a decode core (runtime/disagg); `core` is the decode core
                from kiln.runtime.disagg.service import start_disaggregated
                self.engine = start_disaggregated(self._stack, config, disaggregate)
                self.core, self.prefill_core = self.engine.process, self.engine.prefill.process
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
        except BaseException:
            self._stack.close()
            raise

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self._stack.close()

    def in_engine(self, fn: Callable[..., Any], *args: Any, timeout: float = 10, core: Any = None) -> Any:
        """Runs `fn(engine, *args)` in the engine-core process (`core`: another core's AsyncLLMEngine, e.g. a
        disaggregated server's `engine.prefill`), between two steps. `fn` travels as its code: no closures or
        defaults; the modules it names are imported there; args and result must encode."""
        assert fn.__closure__ is None and fn.__defaults__ is None, f"{fn.__name__} must not capture anything"
        modules = {name: value.__name__ for name, value in fn.__globals__.items()
                   if isinstance(value, types.ModuleType) and name in _names(fn.__code__)}
        call = (core or self.engine).call_utility("test_run", marshal.dumps(fn.__code__), modules, list(args))
        return asyncio.run_coroutine_threadsafe(call, self.engine.loop).result(timeout)

    def wait_idle(self, timeout: float = 20, core: Any = None) -> None:
        """Until the engine (`core`: as in `in_engine`) holds no request; then asserts every KV block is free and
        the pool is consistent."""
        deadline = time.monotonic() + timeout
        while self.in_engine(lambda e: e.has_unfinished_requests(), core=core):
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.02)
        free, total, referenced = self.in_engine(_kv_state, core=core)
        assert referenced == [] and free == total, f"{free}/{total} KV blocks free, refs {referenced}"

    @contextlib.contextmanager
    def slow_steps(self, seconds: float, core: Any = None) -> Iterator[None]:
        """Makes every forward step take at least `seconds` (so a test can act mid-generation)."""
        self.in_engine(_slow_execute, seconds, core=core)
        try:
            yield
        finally:
            if core is None or core.is_running:
                self.in_engine(lambda e: e.runner.__dict__.pop("execute", None) and None, core=core)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets) from /metrics."""
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _names(code: types.CodeType) -> set[str]:
    """The global names `code` and the functions defined in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _kv_state(engine: Any) -> tuple[int, int, list[int]]:
    bm = engine.block_manager
    bm.check_invariants([])
    return bm.num_free_blocks, bm.num_blocks, [r for r in bm.ref_counts if r]


def _slow_execute(engine: Any, seconds: float) -> None:
    execute = type(engine.runner).execute

    def slow(batch: Any, *patch: Any) -> Any:
        time.sleep(seconds)
        return execute(engine.runner, batch, *patch)
    engine.runner.execute = slow
