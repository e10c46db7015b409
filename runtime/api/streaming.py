"""A request's answer: the Formatter base (a group's deltas as OpenAI choices, streamed or collected), the logprob
helpers the formatters share, server-sent events, and the client-disconnect watch that aborts a request whose
client went away. The formatters of each endpoint are in formatters.py."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..errors import KilnRuntimeError
from ..outputs import CompletionDelta, PositionLogprobs, RequestDelta
from .async_engine import RequestGroup
from .chat_plan import RequestPlan
from .metrics import ServerMetrics
from .protocol import APIError
from .responses import ResponseStore


class FormatterServer(Protocol):
    """What a formatter reads of the server it answers for (serving.OpenAIServer)."""

    model_name: str
    tokenizer: Any
    metrics: ServerMetrics
    responses: ResponseStore


# Formatting ------------------------------------------------------------------------------------------------
def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def ranked_logprobs(position: PositionLogprobs, chosen: int, top_n: int) -> list[tuple[int, Any]]:
    """The chosen token first, then the top-N by rank (the chosen one is not repeated)."""
    top = sorted(((t, lp) for t, lp in position.items() if t != chosen and lp.rank is not None and lp.rank <= top_n),
                 key=lambda item: item[1].rank)
    return [(chosen, position[chosen]), *top]


def merge_deltas(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    """`a` then `b`, one completion's consecutive deltas, as one."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or []), *(b.logprobs or [])]
    return CompletionDelta(a.index, a.text + b.text, a.token_ids + b.token_ids, logprobs,
                           b.finish_reason or a.finish_reason, b.stop_reason if b.finish_reason else a.stop_reason)


def token_str(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


class Formatter:
    """Turns a group's deltas into OpenAI choices, one choice per (prompt, completion): index = prompt * n + i.
    The engine runs `num_seqs` completions per prompt (more than n for best_of); `select` picks the n shown."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, server: FormatterServer, req: Any, request_id: str, group: RequestGroup,
                 plan: RequestPlan | None = None) -> None:
        self.server, self.req, self.request_id, self.group = server, req, request_id, group
        self.plan = plan or RequestPlan()
        self.n = req.n
        self.num_seqs = group.params.n
        self.prompt_index = {p.request_id: i for i, p in enumerate(group.inputs)}
        self.num_choices = len(group.inputs) * self.num_seqs
        self.prompt_tokens = sum(len(p.prompt_token_ids) for p in group.inputs)
        self.completion_tokens = 0
        self.reasoning_tokens: int | None = None  # counted when the output ends, if the model thinks
        self.created = int(time.time())
        # per prompt: its logprobs so far (position 0's is None), when the request asked for them
        self.prompt_logprobs: list[list[PositionLogprobs | None]] = [[] for _ in group.inputs]

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage

    def count_reasoning(self, token_ids: list[int]) -> None:
        """A finished choice's reasoning tokens, into usage and /metrics."""
        if self.plan.thinking is None:
            return
        n = self.plan.reasoning_tokens(token_ids)
        self.reasoning_tokens = (self.reasoning_tokens or 0) + n
        self.server.metrics.on_reasoning_tokens(n)

    def choices_of(self, delta: RequestDelta) -> list[tuple[int, Any]]:
        prompt = self.prompt_index[delta.request_id]
        if delta.prompt_logprobs:
            self.prompt_logprobs[prompt].extend(delta.prompt_logprobs)
        base = prompt * self.num_seqs
        return [(base + c.index, c) for c in delta.completions]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object_name, "created": self.created,
                                "model": self.server.model_name, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def stream(self) -> AsyncIterator[str | bytes]:
        """One event per choice that progressed, per batch of deltas: when the client or this loop fell behind
        the core, the steps waiting are merged into one event per choice (fewer, larger writes; never a
        snapshot: each event holds only what is new since the previous one)."""
        try:
            for event in self.stream_start():
                yield event
            streamed: list[list[int]] | None = [[] for _ in range(self.num_choices)] \
                if self.plan.thinking is not None else None
            async for deltas in self.group.batches():
                merged: dict[int, CompletionDelta] = {}
                for delta in deltas:
                    for index, c in self.choices_of(delta):
                        if streamed is not None:
                            streamed[index] += c.token_ids
                            if c.finish_reason is not None:
                                self.count_reasoning(streamed[index])
                        merged[index] = c if index not in merged else merge_deltas(merged[index], c)
                for index, c in merged.items():
                    for choice in self.stream_choices(index, c):
                        yield self.chunk([choice])
            if self.include_usage:
                yield self.chunk([], self.usage())
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield sse(APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"

    def stream_choices(self, index: int, c: Any) -> list[dict[str, Any]]:
        """The chunks' choices one completion delta makes (none, when it adds nothing to show)."""
        self.completion_tokens += len(c.token_ids)
        if c.text or c.finish_reason is not None or c.logprobs or (self.server.tokenizer is None and c.token_ids):
            choice = self.choice_delta(index, c)
            return [] if choice is None else [choice]
        return []

    def stream_start(self) -> list[str]:
        return []

    async def collect(self) -> Response:
        acc: list[dict[str, Any]] = [{"text": [], "token_ids": [], "logprobs": [], "finish_reason": None,
                                      "stop_reason": None} for _ in range(self.num_choices)]
        try:
            async for delta in self.group:
                for index, c in self.choices_of(delta):
                    a = acc[index]
                    a["text"].append(c.text)
                    a["token_ids"].extend(c.token_ids)
                    if c.logprobs is not None:
                        a["logprobs"].extend(c.logprobs)
                    if c.finish_reason is not None:
                        a["finish_reason"], a["stop_reason"] = c.finish_reason, c.stop_reason
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        self.completion_tokens = sum(map(self.num_generated, acc))  # best_of: all were generated
        for a in acc:
            self.count_reasoning(a["token_ids"])
        body = {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.server.model_name,
                "choices": [self.full_choice(i, a) for i, a in enumerate(self.select(acc))], "usage": self.usage()}
        return JSONResponse(body)

    def num_generated(self, a: dict[str, Any]) -> int:
        return len(a["token_ids"])

    def select(self, acc: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The n completions shown per prompt, in choice order (each remembers its prompt in "prompt")."""
        for i, a in enumerate(acc):
            a["prompt"] = i // self.num_seqs
        if self.num_seqs == self.n:
            return acc
        chosen = []
        for p in range(len(self.group.inputs)):  # best_of: the n of highest cumulative logprob
            seqs = acc[p * self.num_seqs:(p + 1) * self.num_seqs]
            chosen += sorted(seqs, key=_cumulative_logprob, reverse=True)[:self.n]
        return chosen

    def choice_delta(self, index: int, c: Any) -> dict[str, Any] | None:
        """None: nothing to send for this delta (text a parser holds back)."""
        raise NotImplementedError

    def full_choice(self, index: int, acc: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


def _cumulative_logprob(acc: dict[str, Any]) -> float:
    return math.fsum(position[t].logprob for t, position in zip(acc["token_ids"], acc["logprobs"]))


json_encode = msgspec.json.Encoder().encode


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event. msgspec's JSON encoder: compact, UTF-8 unescaped, several times json.dumps' speed
    (an event per token per stream is the server's hottest path); non-finite floats never get here (finite_logprob)."""
    return b"data: " + json_encode(body) + b"\n\n"


async def respond(request: Request, fmt: Formatter) -> Response:
    """The formatted answer: streamed as SSE, or collected into one body; either way the group is aborted when
    the client goes away."""
    if fmt.req.stream:
        return SSEResponse(fmt.stream(), on_close=fmt.group.abort)
    return await until_disconnect(request, fmt.collect(), on_close=fmt.group.abort)


# Client disconnects ----------------------------------------------------------------------------------------
async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and call `on_close`, as soon as the client goes away, even while the
    request is still waiting in the queue and no event is being written."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            self.on_close()
            await self.body_iterator.aclose()
        if pump.done() and not pump.cancelled() and pump.exception() is not None \
                and not isinstance(pump.exception(), OSError):
            raise pump.exception()


async def until_disconnect(request: Request, work: Awaitable[Response],
                           on_close: Callable[[], None]) -> Response:
    """Runs a non-streamed request to completion unless its client disconnects first (then aborts it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
        on_close()
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()
