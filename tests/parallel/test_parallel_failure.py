"""A failed executor stops the engine core, also when nothing is in flight: a mesh executor's `on_failure` (its
rank monitor saw a worker exit) makes the core's loop fail every request and exit 1 (`_executor_died`), and the
API server then sees its core gone (/health 503, `kiln serve` exits 1: tests/server/test_core_process.py). The
process mesh itself is test_parallel_gloo.py's and test_parallel_serve.py's (a rank killed mid-request)."""
from __future__ import annotations

import types

import pytest
from kiln.runtime.core.process import EngineCoreProc
from kiln.runtime.worker.interface import ExecutorError


class _Stopped(Exception):
    pass


def test_an_idle_executor_failure_stops_the_core_loop():
    callbacks: list = []
    runner = types.SimpleNamespace(on_failure=callbacks.append)
    engine = types.SimpleNamespace(runner=runner, has_unfinished_requests=lambda: False)
    proc = EngineCoreProc.__new__(EngineCoreProc)  # the loop alone: no sockets, no heartbeat thread
    proc.engine, proc.config = engine, types.SimpleNamespace(heartbeat_interval=0.01)
    proc.executor_failure, proc.pollers, proc.deferred = None, [], []
    polls: list[int] = []

    def receive(timeout_ms: int) -> bool:
        polls.append(timeout_ms)
        if len(polls) == 3:  # the monitor thread reports while the core idles
            callbacks[0]("rank 1's worker (pid 1) exited with status -9")
        return False

    died: list[ExecutorError] = []

    def executor_died(error: ExecutorError) -> None:
        died.append(error)
        raise _Stopped

    proc._receive, proc._expire_clients, proc._heartbeats = receive, lambda: None, lambda: None
    proc._executor_died, proc._update_stats = executor_died, lambda: None
    with pytest.raises(_Stopped):
        proc.run()
    assert len(callbacks) == 1 and len(polls) == 3
    assert len(died) == 1 and isinstance(died[0], ExecutorError) and "rank 1's worker" in str(died[0])
