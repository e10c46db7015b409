"""AsyncLLMEngine: the API server's engine. Requests go to an engine core (its own process) over the engine-core
protocol; the core's token deltas come back through the output processor as per-request text deltas."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import KilnRuntimeError, RequestError
from ..ipc.client import AsyncCoreClient, CoreProcess, EngineDeadError
from ..ipc.protocol import (
    Abort,
    AddRequests,
    AddResult,
    CoreInfo,
    CoreStats,
    Heartbeat,
    NewRequest,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    encode_params,
)
from ..outputs import RequestDelta
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer, open_tokenizer
from ..validation import check_request
from .output_processor import OutputProcessor

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineOverloadedError", "PromptInput", "RequestFailedError",
           "RequestGroup", "RequestObserver"]


class EngineOverloadedError(KilnRuntimeError):
    """The waiting queue is full, or the engine core is not running: the server answers 503."""


class RequestFailedError(KilnRuntimeError):
    """The engine failed this request (non-finite logits, a failure only its parameters hit, a step that
    raised); the message says why."""


@dataclass(slots=True)
class PromptInput:
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None


class RequestGroup:
    """The engine requests of one API call (one per prompt), sharing one queue of deltas.

    Iterate it for deltas in arrival order; it stops once every request finished and raises the engine's
    error if one failed. `abort()` stops the unfinished requests and frees their KV blocks; a handler calls it
    in `finally`, so a client that goes away never leaves work behind.
    """

    def __init__(self, engine: AsyncLLMEngine, inputs: list[PromptInput], params: SamplingParams) -> None:
        self._engine = engine
        self.inputs = inputs
        self.params = params
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.unfinished = {p.request_id for p in inputs}
        self.first_token_at: dict[str, float] = {}  # request id -> when its first token came (monotonic)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while self.unfinished:
            delta = await self.queue.get()
            if delta.error is not None:
                self.abort()
                raise delta.error
            if delta.finished:
                self.unfinished.discard(delta.request_id)
            yield delta

    async def batches(self) -> AsyncIterator[list[RequestDelta]]:
        """Like iterating, but each item is every delta waiting at that moment (at least one), in order."""
        queue = self.queue
        while self.unfinished:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for i, delta in enumerate(batch):
                if delta.error is not None:
                    if i:
                        yield batch[:i]
                    self.abort()
                    raise delta.error
                if delta.finished:
                    self.unfinished.discard(delta.request_id)
            yield batch

    def abort(self) -> None:
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()


@dataclass(slots=True)
class _Tracked:
    """Front-end bookkeeping of one request: its group, and its latency milestones."""

    group: RequestGroup
    arrival: float
    last_token_time: float | None = None


class RequestObserver:
    """Hooks the metrics layer implements; called on the event loop (must be cheap)."""

    def on_queued(self, seconds: float) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: ...
    def on_finished(self, e2e_seconds: float, finish_reason: str | None) -> None: ...


class AsyncLLMEngine:
    """Talks to one engine core from the server's event loop: `add_requests` sends a group of prompts and waits
    until the core accepted them (or refused: `RequestError`, 400; `EngineOverloadedError`, 503), the core's
    step outputs are read by one task, detokenized and stop-checked by the `OutputProcessor`, and delivered to
    each group's queue. A completion that hit a stop string is ended in the core too.

    The core is watched two ways: `process` (the one this server owns) by a thread waiting on it, and any core
    by its heartbeats: nothing heard for `heartbeat_timeout` seconds means it is gone. Either way every
    request in flight fails with one `EngineDeadError`, `is_running` turns False (/health answers 503) and
    the `on_dead` callbacks run (`kiln serve` exits non-zero).
    """

    def __init__(self, info: CoreInfo, tokenizer: Tokenizer | None, *, process: CoreProcess | None = None,
                 client_name: str = "api-0", observer: RequestObserver | None = None,
                 heartbeat_interval: float = 0.5, heartbeat_timeout: float = 10.0) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.process = process
        self.client_name = client_name
        self.observer = observer or RequestObserver()
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.max_waiting = info.max_waiting
        self.stats = CoreStats()
        self._stats_version = -1
        self.processor = OutputProcessor(tokenizer)
        self.client: AsyncCoreClient | None = None
        self.dead: str | None = None  # why the core is gone
        self.on_dead: list[Callable[[str], None]] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    @classmethod
    def from_process(cls, process: CoreProcess, **kwargs: Any) -> AsyncLLMEngine:
        """The engine over a core this server started; its tokenizer is read from the artifact."""
        info = process.info
        tokenizer = open_tokenizer(info.tokenizer_dir, info.limits.vocab_size) if info.tokenizer_dir else None
        return cls(info, tokenizer, process=process, **kwargs)

    # Lifecycle (event loop) -------------------------------------------------------------------------------
    async def start(self) -> None:
        assert self.client is None, "already started"
        self.loop = asyncio.get_running_loop()
        self.client = AsyncCoreClient(self.info.input_address, name=self.client_name)
        self.info = await self.client.connect()
        self._tasks = [asyncio.ensure_future(self._read_outputs()), asyncio.ensure_future(self._watch())]
        if self.process is not None:
            threading.Thread(target=self._wait_for_process, name="kiln-core-sentinel", daemon=True).start()

    async def shutdown(self) -> None:
        self._closing = True
        self._fail_all(KilnRuntimeError("the server is shutting down"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            self.client.close()

    @property
    def is_running(self) -> bool:
        return self.client is not None and self.dead is None and not self._closing

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Runs a named core utility (core/process.py: EngineCoreProc.register_utility) between two steps."""
        reply = await self._call(UtilityCall(next(self._call_ids), method, list(args)), timeout)
        if reply.error is not None:
            raise KilnRuntimeError(f"utility {method!r} failed in the engine core: {reply.error}")
        return reply.result

    async def _call(self, msg: AddRequests | UtilityCall, timeout: float | None = None) -> Any:
        if not self.is_running:
            raise EngineOverloadedError(f"the engine core is not running ({self.dead or 'not started'})")
        future = self.loop.create_future()
        self._calls[msg.call_id] = future
        self.client.send(msg)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            self._calls.pop(msg.call_id, None)

    # Requests (event loop) --------------------------------------------------------------------------------
    def check_admissible(self, num_prompts: int, params: SamplingParams) -> None:
        """Raises `RequestError` for a request of more sequences than the queue may ever hold."""
        num_seqs = num_prompts * params.n
        if num_seqs > self.max_waiting:
            raise RequestError(f"the request asks for {num_seqs} sequences ({num_prompts} prompt(s) x n={params.n})"
                               f" but at most {self.max_waiting} can wait at once; send fewer prompts or a lower n")

    async def add_requests(self, inputs: list[PromptInput], params: SamplingParams,
                           lora_name: str | None = None) -> RequestGroup:
        """Queues all of `inputs` or none: raises `RequestError` (it can never be queued, or the first bad
        prompt; nothing stays queued) or `EngineOverloadedError` (not now)."""
        self.check_admissible(len(inputs), params)
        for p in inputs:
            check_request(p.prompt_token_ids, params, self.info.limits)
        group = RequestGroup(self, inputs, params)
        arrival = time.monotonic()
        for p in inputs:  # before the core can answer: its first deltas find the state
            self.processor.add_request(p.request_id, p.prompt_token_ids, params, p.prompt,
                                       _Tracked(group, arrival))
        try:
            result: AddResult = await self._queue(inputs, params, lora_name)
        except BaseException:
            group.abort()  # queued behind the add: the core aborts whatever got added
            raise
        if result.error is not None:
            for p in inputs:
                self.processor.abort_request(p.request_id)
            group.unfinished.clear()
            raise (EngineOverloadedError if result.overloaded else RequestError)(result.error)
        self.observer.on_tokens(sum(len(p.prompt_token_ids) for p in inputs), 0)
        return group

    async def _queue(self, inputs: list[PromptInput], params: SamplingParams,
                     lora_name: str | None = None) -> AddResult:
        """Sends the requests to the core (runtime/disagg's router overrides this: reserve, then prefill)."""
        raw = encode_params(params)
        return await self._call(AddRequests(next(self._call_ids), [
            NewRequest(p.request_id, p.prompt_token_ids, raw, lora_name=lora_name) for p in inputs]))

    def abort(self, request_ids: list[str]) -> None:
        """Ends requests in the core and here; nothing more is delivered for them."""
        for request_id in request_ids:
            self.processor.abort_request(request_id)
        if self.is_running:
            self.client.send(Abort(request_ids))

    # The core's outputs -----------------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                if isinstance(msg, StepOutputs):
                    self._take_stats(msg.version, msg.stats)
                    self._on_step(msg)
                elif isinstance(msg, (AddResult, UtilityResult)):
                    future = self._calls.pop(msg.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(msg)
                elif isinstance(msg, Heartbeat) and msg.stats is not None:
                    self._take_stats(msg.version, msg.stats)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a message that does not decode, or a bug here: nothing else can be trusted
            logger.exception("reading the engine core's outputs failed")
            self._core_died(f"its outputs could not be read ({type(e).__name__}: {e})")

    def _take_stats(self, version: int, stats: CoreStats) -> None:
        if version >= self._stats_version:  # heartbeats travel on their own socket: keep the newest
            self._stats_version, self.stats = version, stats

    def _on_step(self, msg: StepOutputs) -> None:
        processor, observer = self.processor, self.observer
        for request_id, waited in msg.scheduled:
            if request_id in processor.requests:
                observer.on_queued(waited)
        processed = processor.process(msg.deltas)
        if processed.finish_in_core or processed.abort_in_core:
            self.client.send(Abort(processed.abort_in_core, processed.finish_in_core))
        now = time.monotonic()
        for state in processed.touched:
            tracked: _Tracked = state.owner
            if state.error is not None:
                observer.on_finished(now - tracked.arrival, "error")
                tracked.group.queue.put_nowait(RequestDelta(state.request_id, [], len(state.prompt_token_ids), True,
                                                            RequestFailedError(state.error)))
                continue
            delta = processor.take_delta(state)
            num_new = sum(len(c.token_ids) for c in delta.completions)
            if num_new:
                if tracked.last_token_time is None:
                    observer.on_first_token(now - tracked.arrival)
                    tracked.group.first_token_at[state.request_id] = now
                else:
                    observer.on_inter_token(now - tracked.last_token_time)
                tracked.last_token_time = now
                observer.on_tokens(0, num_new)
            if state.finished:
                observer.on_finished(now - tracked.arrival, state.seqs[0].finish_reason)
            if delta.completions or delta.finished or delta.prompt_logprobs:
                tracked.group.queue.put_nowait(delta)

    # Liveness ---------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self.client.send_heartbeat()
            silent = time.monotonic() - self.client.last_seen
            if silent > self.heartbeat_timeout:
                self._core_died(f"it sent nothing for {silent:.1f} s (heartbeat timeout {self.heartbeat_timeout:g} s)")
                return

    def _wait_for_process(self) -> None:
        self.process.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server is gone
            self.loop.call_soon_threadsafe(self._core_died, f"its process {self.process.describe_exit()}")

    def _core_died(self, why: str) -> None:
        if self.dead is not None or self._closing:
            return
        self.dead = why
        logger.error("the engine core is gone: %s; failing %d request(s)", why, len(self.processor.requests))
        self._fail_all(EngineDeadError(f"the engine core is gone: {why}; the request could not be finished"))
        for callback in self.on_dead:
            callback(why)

    def _fail_all(self, error: KilnRuntimeError) -> None:
        for request_id, state in list(self.processor.requests.items()):
            self.processor.abort_request(request_id)
            state.owner.group.queue.put_nowait(RequestDelta(request_id, [], len(state.prompt_token_ids), True, error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineOverloadedError(str(error)))
        self._calls.clear()
