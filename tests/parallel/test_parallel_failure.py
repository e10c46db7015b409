"""A failed executor stops the server's engine loop (runtime/async_engine.py), also when nothing is in flight:
a mesh executor's `on_failure` (its rank monitor saw a worker exit) ends the loop with `fatal_error` and calls
`on_fatal` (kiln serve then exits 1). The process mesh itself is test_parallel_gloo.py's and
test_parallel_serve.py's."""
from __future__ import annotations

import asyncio

from kiln.runtime.async_engine import AsyncLLMEngine
from kiln.runtime.engine import LLMEngine
from kiln.runtime.executor import ExecutorError


def test_an_idle_executor_failure_stops_the_loop(compile_parallel):
    _, art = compile_parallel("llama", None)
    engine = LLMEngine(str(art), num_kv_blocks=16)
    callbacks = []
    engine.runner.on_failure = callbacks.append  # what a mesh executor offers
    async_engine = AsyncLLMEngine(engine)
    fatal = []
    async_engine.on_fatal = fatal.append

    async def run() -> None:
        async_engine.start()
        assert async_engine.is_running and len(callbacks) == 1
        callbacks[0]("rank 1's worker (pid 1) exited with status -9")
        for _ in range(200):
            if not async_engine.is_running:
                break
            await asyncio.sleep(0.025)

    asyncio.run(run())
    assert not async_engine.is_running
    assert isinstance(async_engine.fatal_error, ExecutorError) and "rank 1's worker" in str(async_engine.fatal_error)
    assert fatal == [async_engine.fatal_error]
