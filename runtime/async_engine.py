"""AsyncLLMEngine: drives an LLMEngine from one background thread; asyncio handlers get per-request deltas."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .engine import LLMEngine
from .errors import KilnRuntimeError, RequestError
from .executor import ExecutorError
from .outputs import FinishReason, PositionLogprobs, RequestOutput
from .sampling_params import SamplingParams
from .sequence import SequenceStatus

logger = logging.getLogger(__name__)


class EngineOverloadedError(KilnRuntimeError):
    """The waiting queue is full: the server answers 503 and the client retries later."""


class EngineStepError(KilnRuntimeError):
    """`LLMEngine.step()` raised (the engine fails what it can pin on one request itself, see `LLMEngine`):
    every request that was in the engine at that moment is failed with this."""


class RequestFailedError(KilnRuntimeError):
    """The engine failed this request alone (non-finite logits, a failure only its parameters hit); the
    message says why."""


@dataclass(slots=True)
class CompletionDelta:
    """What one of a request's `n` completions produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta]
    num_prompt_tokens: int
    finished: bool
    error: BaseException | None = None


@dataclass(slots=True)
class PromptInput:
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None = None


class RequestGroup:
    """The engine requests of one API call (one per prompt), sharing one queue of deltas.

    Iterate it for deltas in arrival order; it stops once every request finished and raises the engine's
    error if a step failed. `abort()` (also called by `close()`) stops the unfinished requests and frees their
    KV blocks; a handler calls it in `finally`, so a client that goes away never leaves work behind.
    """

    def __init__(self, engine: AsyncLLMEngine, inputs: list[PromptInput], params: SamplingParams) -> None:
        self._engine = engine
        self.inputs = inputs
        self.params = params
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.unfinished = {p.request_id for p in inputs}

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while self.unfinished:
            delta = await self.queue.get()
            if delta.error is not None:
                self.abort()
                raise delta.error
            if delta.finished:
                self.unfinished.discard(delta.request_id)
            yield delta

    def abort(self) -> None:
        if self.unfinished:
            self._engine._submit(("abort", list(self.unfinished)))
            self.unfinished.clear()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request: what was already sent, and its latency milestones."""

    group: RequestGroup
    num_prompt_tokens: int
    arrival: float
    holdback: int  # chars of text withheld while unfinished: a stop string may still cut them off
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    scheduled: bool = False
    last_token_time: float | None = None


@dataclass(slots=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # blocks looked up
    prefix_cache_hits: int = 0
    spec_num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and of them accepted
    spec_num_accepted_tokens: int = 0
    num_nonfinite_logits: int = 0  # requests failed because their logits were NaN or infinite


class RequestObserver:
    """Hooks the metrics layer implements; called from the engine thread (must be thread-safe and cheap)."""

    def on_queued(self, seconds: float) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: ...
    def on_finished(self, e2e_seconds: float, finish_reason: str | None) -> None: ...


class AsyncLLMEngine:
    """Owns the engine exclusively: only the engine thread calls into `LLMEngine`. Handlers talk to it through
    a command queue (add, abort) and receive deltas through their group's asyncio queue.

    `max_waiting` bounds the sequences (prompts x n) accepted but not running: queued, or preempted and waiting
    to run again. A request that would take the count past it raises `EngineOverloadedError` (retry later) and
    queues nothing; one with more sequences than `max_waiting` could never be taken and raises `RequestError`.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024,
                 observer: RequestObserver | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer or RequestObserver()
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._unscheduled: set[str] = set()
        self._num_pending_adds = 0  # sequences submitted that the engine thread has not queued yet
        self._num_waiting = 0  # sequences waiting in the engine (queued or preempted; engine-thread view)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0
        # the executor could not run another step (a parallel artifact's rank died or hung): the loop has stopped,
        # every request in flight failed with it; `on_fatal(error)` (a server stops) is called from the engine thread
        self.fatal_error: ExecutorError | None = None
        self.on_fatal: Callable[[ExecutorError], None] | None = None
        watch = getattr(engine.runner, "on_failure", None)  # a mesh executor tells of a dead rank while idle too
        if watch is not None:
            watch(lambda reason: self._submit(("fatal", ExecutorError(f"the model's ranks cannot run: {reason}"))))

    # Lifecycle (event-loop side) -------------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "engine loop already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Runs `fn(engine)` between two steps; for inspection (tests, admin endpoints)."""
        future = self._loop.create_future()
        self._submit(("call", fn, future))
        return future

    # Requests (event-loop side) --------------------------------------------------------------------------
    def check_admissible(self, num_prompts: int, params: SamplingParams) -> None:
        """Raises `RequestError` for a request of more sequences than the queue may ever hold."""
        num_seqs = num_prompts * params.n
        if num_seqs > self.max_waiting:
            raise RequestError(f"the request asks for {num_seqs} sequences ({num_prompts} prompt(s) x n={params.n})"
                               f" but at most {self.max_waiting} can wait at once; send fewer prompts or a lower n")

    async def add_requests(self, inputs: list[PromptInput], params: SamplingParams) -> RequestGroup:
        """Queues all of `inputs` or none: raises `RequestError` (it can never be queued, or the first bad
        prompt; nothing stays queued) or `EngineOverloadedError` (not now)."""
        self.check_admissible(len(inputs), params)
        if not self.is_running:
            raise EngineOverloadedError("the engine loop is not running")
        num_seqs = len(inputs) * params.n
        waiting = self._num_pending_adds + self._num_waiting
        if waiting + num_seqs > self.max_waiting:
            raise EngineOverloadedError(
                f"the server is overloaded ({waiting} sequences waiting, this request adds {num_seqs}, limit "
                f"{self.max_waiting}); retry later")
        group = RequestGroup(self, inputs, params)
        accepted = self._loop.create_future()
        self._num_pending_adds += num_seqs
        try:
            self._submit(("add", group, time.monotonic(), accepted))
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            group.abort()  # queued behind the add: the engine thread aborts whatever got added
            raise
        finally:
            self._num_pending_adds -= num_seqs
        return group

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)

    # The engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            commands = [self._commands.get()] if idle else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if any(c[0] == "stop" for c in commands):
                self._fail_all(KilnRuntimeError("the server is shutting down"))
                return
            fatal = next((c[1] for c in commands if c[0] == "fatal"), None)
            if fatal is not None:
                self._die(fatal)
                return
            try:
                for command in commands:
                    self._apply(command)
                if not engine.has_unfinished_requests():
                    self._update_stats()
                    continue
                start = time.monotonic()
                outputs = engine.step()
                self._after_step(outputs, start)
            except ExecutorError as e:  # nothing can run any more: fail everything and stop
                self._die(e)
                return
            except Exception as e:  # a failure fails the requests in flight, never the loop
                logger.exception("engine step failed; failing %d in-flight request(s)", len(self._tracked))
                self.num_step_errors += 1
                self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))

    def _die(self, error: ExecutorError) -> None:
        logger.error("%s; failing %d in-flight request(s) and stopping", error, len(self._tracked))
        self.fatal_error = error
        self._fail_all(EngineStepError(str(error)))
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, group, arrival, accepted = command
            self._add(group, arrival, accepted)
        elif kind == "abort":
            for request_id in command[1]:
                self._abort(request_id)
        elif kind == "call":
            _, fn, future = command
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # handed back to the caller
                result, error = None, e
            self._post(_settle, [(future, result, error)])

    def _add(self, group: RequestGroup, arrival: float, accepted: asyncio.Future) -> None:
        added: list[str] = []
        error: BaseException | None = None
        params = group.params
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        try:
            for p in group.inputs:
                self.engine.add_request(p.request_id, p.prompt_token_ids, params, prompt=p.prompt)
                added.append(p.request_id)
                self._tracked[p.request_id] = _Tracked(
                    group, len(p.prompt_token_ids), arrival, holdback, sent_tokens=[0] * params.n,
                    sent_chars=[0] * params.n, done=[False] * params.n)
                self._unscheduled.add(p.request_id)
        except Exception as e:  # RequestError is the client's; anything else is reported too
            error = e if isinstance(e, RequestError) else RequestError(f"cannot add the request: {e}")
            for request_id in added:
                self._abort(request_id)
        else:
            self.observer.on_tokens(sum(len(p.prompt_token_ids) for p in group.inputs), 0)
        self._update_stats()
        self._post(_settle, [(accepted, None, error)])

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is None:
            return
        self._unscheduled.discard(request_id)
        self._abort_untracked(request_id)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for request_id, tracked in list(self._tracked.items()):
            deliveries.append((tracked.group, RequestDelta(request_id, [], tracked.num_prompt_tokens, True, error)))
            self._abort(request_id)
        for request_id in list(self.engine.requests):  # requests the engine holds that nobody tracks
            self._abort_untracked(request_id)
        self.engine._drain_aborted()
        self._post(_deliver, deliveries)
        self._update_stats()

    def _abort_untracked(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # best effort after a failed step; the request is gone either way
            self.engine.requests.pop(request_id, None)

    def _after_step(self, outputs: list[RequestOutput], start: float) -> None:
        now = time.monotonic()
        observer = self.observer
        for request_id in list(self._unscheduled):
            request = self.engine.requests.get(request_id)
            if request is None or any(s.status is not SequenceStatus.WAITING for s in request.seqs):
                self._unscheduled.discard(request_id)
                observer.on_queued(start - self._tracked[request_id].arrival)
        deliveries = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted by its client: nobody is listening
                continue
            if out.error is not None:  # the engine failed this request alone
                del self._tracked[out.request_id]
                self._unscheduled.discard(out.request_id)
                observer.on_finished(now - tracked.arrival, "error")
                deliveries.append((tracked.group, RequestDelta(out.request_id, [], tracked.num_prompt_tokens, True,
                                                               RequestFailedError(out.error))))
                continue
            delta = self._delta(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
                observer.on_finished(now - tracked.arrival, out.outputs[0].finish_reason)
            if delta.completions or delta.finished:
                deliveries.append((tracked.group, delta))
        self._post(_deliver, deliveries)
        self._update_stats()

    def _delta(self, tracked: _Tracked, out: RequestOutput, now: float) -> RequestDelta:
        """The new part of each completion. Text is withheld by `holdback` chars until the completion ends,
        so a stop string that completes later never shows up in the stream (the engine cuts it from the text)."""
        completions = []
        num_new = 0
        for c in out.outputs:
            i = c.index
            if tracked.done[i]:
                continue
            finished = c.finish_reason is not None
            start_tok, start_chr = tracked.sent_tokens[i], tracked.sent_chars[i]
            end_chr = len(c.text) if finished else max(start_chr, len(c.text) - tracked.holdback)
            new_ids = c.token_ids[start_tok:]
            new_text = c.text[start_chr:end_chr]
            if not (new_ids or new_text or finished):
                continue
            tracked.sent_tokens[i] = len(c.token_ids)
            tracked.sent_chars[i] = max(start_chr, end_chr)
            tracked.done[i] = finished
            num_new += len(new_ids)
            completions.append(CompletionDelta(
                index=i, text=new_text, token_ids=new_ids,
                logprobs=c.logprobs[start_tok:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if num_new:
            if tracked.last_token_time is None:
                self.observer.on_first_token(now - tracked.arrival)
            else:
                self.observer.on_inter_token(now - tracked.last_token_time)
            tracked.last_token_time = now
            self.observer.on_tokens(0, num_new)
        return RequestDelta(out.request_id, completions, tracked.num_prompt_tokens, out.finished)

    def _update_stats(self) -> None:
        s = self.engine.stats()
        self._num_waiting = s["num_waiting"]
        self.stats = EngineStats(
            num_requests_running=s["num_running"], num_requests_waiting=s["num_waiting"],
            kv_cache_usage=s["kv_usage"], num_preemptions=s["num_preemptions"],
            prefix_cache_queries=s["prefix_cache_queries"], prefix_cache_hits=s["prefix_cache_hits"],
            spec_num_draft_tokens=s["spec_num_draft_tokens"], spec_num_accepted_tokens=s["spec_num_accepted_tokens"],
            num_nonfinite_logits=s["num_nonfinite_logits"])

    def _post(self, fn: Callable[[list], None], items: list) -> None:
        if not items:
            return
        try:
            self._loop.call_soon_threadsafe(fn, items)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass


def _deliver(items: list[tuple[RequestGroup, RequestDelta]]) -> None:
    for group, delta in items:
        group.queue.put_nowait(delta)


def _settle(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
