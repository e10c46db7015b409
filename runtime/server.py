"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, SSE streaming, Prometheus metrics.

`kiln serve` runs two processes: this API server (HTTP, tokenization, chat templates, detokenization, stop
strings, SSE) and the engine core it starts and owns (scheduler, KV cache, model runner, sampler), which it
talks to over the engine-core protocol (core_protocol.py). The model never shares a GIL with HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import threads
from .async_engine import AsyncLLMEngine, PromptInput, RequestGroup
from .core_client import CoreProcess
from .core_protocol import CoreConfig, CoreInfo
from .errors import KilnRuntimeError, RequestError
from .metrics import CONTENT_TYPE, ServerMetrics
from .outputs import PositionLogprobs, RequestDelta
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, request_error_param
from .sampling_params import SamplingParams

MAX_BODY_BYTES = 16 * 2**20
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this (a stalled upload gets 408)
_LONG_PROMPT_CHARS = 8192  # tokenized (chat templates: rendered) off the event loop beyond this
_Req = TypeVar("_Req", bound=BaseModel)
_T = TypeVar("_T")


def resolve_served_name(info: CoreInfo, override: str | None = None) -> str:
    """`--served-model-name`, else the recipe's `serve.served_name` from the manifest, else the directory name."""
    return override or info.served_name or Path(info.artifact).name


class OpenAIServer:
    """Request handling, independent of routing: parse -> validate -> tokenize -> submit -> format.

    A text prompt can hold at most `max_prompt_chars` characters: max_model_len tokens of the longest token in
    the vocabulary (no token stands for more characters than its own string has). A longer one could not fit
    the context (unless a normalizer deletes characters) and is refused before it is tokenized. Long texts are tokenized, and long chat templates
    rendered, on a thread pool of their own: the tokenizers library releases the GIL while it encodes, so the
    event loop (and `/health`) keeps answering.
    """

    def __init__(self, engine: AsyncLLMEngine, *, model_name: str, api_key: str | None = None,
                 metrics_public: bool = False) -> None:
        self.model_name = model_name
        self.api_key = api_key
        self.metrics_public = metrics_public
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.limits.max_model_len
        self.max_prompt_chars = self.max_model_len * _longest_token_chars(engine.tokenizer)
        self.metrics = ServerMetrics(model_name, lambda: self.async_engine.stats, engine.info.limits.block_size)
        for collector in getattr(engine, "metrics_collectors", ()):  # a disaggregated router's (runtime/disagg)
            self.metrics.registry.register(collector)
        self.async_engine = engine
        engine.observer = self.metrics
        self.created = int(time.time())
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-tokenize")

    # Request plumbing --------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def parse(self, request: Request, schema: type[_Req]) -> _Req:
        """Authenticates, then reads the body (`BodyLimit` bounds its size and the time it may take). A big body
        costs the event loop one pass of JSON parsing in one go, nothing more: it is gathered as it arrives
        (no join at the end) and checked for UTF-8 only when the parse fails."""
        self.check_auth(request)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
        try:
            parsed = schema.model_validate_json(body)
        except ValidationError as e:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as u:
                raise APIError(400, f"the request body is not valid UTF-8 ({u.reason} at byte {u.start})") from None
            raise _validation_error(e) from None
        if parsed.model != self.model_name:
            raise APIError(404, f"The model {parsed.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        parsed.check_supported()
        return parsed

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, at most "
                           f"{self.max_prompt_chars} characters of text; the prompt has {num_chars} characters. "
                           "Shorten the prompt.", param=param, code="context_length_exceeded")

    async def encode(self, texts: list[str], add_special_tokens: bool = True,
                     param: str = "prompt") -> list[list[int]]:
        """Token ids of each text, refusing (before any tokenizing) a text that could not fit the context."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        for text in texts:
            self.check_prompt_chars(len(text), param)
        encode = self.tokenizer.encode
        if sum(map(len, texts)) <= _LONG_PROMPT_CHARS:
            return [encode(text, add_special_tokens) for text in texts]
        return await self.off_loop(lambda: [encode(text, add_special_tokens) for text in texts])

    async def off_loop(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn)

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs)
        except RequestError as e:
            raise APIError(400, str(e), param=request_error_param(e, set(type(req).model_fields))) from None

    def check_admissible(self, num_prompts: int, params: SamplingParams,
                         req: ChatCompletionRequest | CompletionRequest) -> None:
        """400 (before anything is tokenized) for more sequences than the queue could ever take."""
        try:
            self.async_engine.check_admissible(num_prompts, params)
        except RequestError as e:
            param = "n" if params.n > 1 else "prompt" if isinstance(req, CompletionRequest) else "messages"
            raise APIError(400, str(e), param=param, code="too_many_sequences") from None

    async def submit(self, inputs: list[PromptInput], params: SamplingParams,
                     req: ChatCompletionRequest | CompletionRequest) -> RequestGroup:
        """Queues every prompt or none: 400 for a request that can never be served (a prompt too long, more
        sequences than the queue holds, ...), 503 when it could be later but the queue is full now."""
        prompt_param = "prompt" if isinstance(req, CompletionRequest) else "messages"
        limit = self.max_model_len
        for p in inputs:
            n = len(p.prompt_token_ids)
            if n >= limit or (params.max_tokens is not None and n + params.max_tokens > limit):
                asked = f"{n} in the prompt" + (f", {params.max_tokens} in the completion" if params.max_tokens
                                                else "")
                raise APIError(400, f"This model's maximum context length is {limit} tokens; the request asks "
                               f"for {n + (params.max_tokens or 0)} ({asked}). Shorten the prompt or lower "
                               "max_tokens.", param=prompt_param if n >= limit else "max_tokens",
                               code="context_length_exceeded")
        try:
            return await self.async_engine.add_requests(inputs, params)
        except RequestError as e:
            param = request_error_param(e, set(type(req).model_fields)) or prompt_param
            raise APIError(400, str(e), param=param) from None
        except KilnRuntimeError as e:  # overloaded, or the engine core is gone
            raise APIError(503, str(e), type="server_error", code="overloaded") from None

    # /v1/completions ---------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = req.prompts()
        self.check_admissible(len(prompts), params, req)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.encode(texts) if texts else [])
        inputs = [PromptInput(f"{request_id}-{i}", next(encoded), p) if isinstance(p, str)
                  else PromptInput(f"{request_id}-{i}", p) for i, p in enumerate(prompts)]
        group = await self.submit(inputs, params, req)
        return await _respond(request, _CompletionFormatter(self, req, request_id, group))

    # /v1/chat/completions ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        params = self.sampling_params(req, req.resolved_max_tokens(), req.num_logprobs())
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions with "
                           "token ids", param="messages")
        self.check_admissible(1, params, req)
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        num_chars = sum(len(m["content"]) for m in messages)  # a template adds to the text, never cuts it
        self.check_prompt_chars(num_chars, "messages")

        def render() -> str:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      **(req.chat_template_kwargs or {}))
        try:
            text = render() if num_chars <= _LONG_PROMPT_CHARS else await self.off_loop(render)
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # the template raised on these messages (raise_exception, ...)
            raise APIError(400, f"the chat template rejected the messages: {type(e).__name__}: {e}",
                           param="messages") from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [ids] = await self.encode([text], add_special_tokens=False, param="messages")
        group = await self.submit([PromptInput(request_id, ids, text)], params, req)
        return await _respond(request, _ChatFormatter(self, req, request_id, group))

    # /v1/models --------------------------------------------------------------------------------------------
    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kiln",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: the longest token string of the vocabulary (byte-level BPE
    spells each byte as one character, so its strings are at least as long as the text they decode to)."""
    if tokenizer is None:
        return 1
    return max(1, max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)))


class BodyLimit:
    """ASGI middleware: a request body may hold at most `max_bytes` and must arrive within `timeout` seconds
    of the request's start. Counted as the body streams in: a declared Content-Length over the limit is
    answered 413 before a byte of it is read, a chunked body once it passes the limit, a stalled one 408 at
    the deadline. A response that starts before its request's body was read to the end (these, a 401, ...)
    closes the connection: the rest of the body is never read, and the client must not wait on it. A client
    that goes away mid-upload ends its request quietly (`ClientDisconnect`, answered by `build_app`)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        complete = declared in (None, b"0") and b"transfer-encoding" not in headers  # no body to wait for
        received = 0

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not complete:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = self.too_large(int(declared))
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, closing_send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large(received, streamed=True)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, closing_send)

    def too_large(self, size: int, streamed: bool = False) -> APIError:
        what = f"more than {self.max_bytes} bytes of request body arrived" if streamed else \
            f"request body of {size} bytes"
        return APIError(413, f"{what}; the limit is {self.max_bytes} bytes")


def _validation_error(e: ValidationError) -> APIError:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    # Union members add their type name to the location ("prompt.list[int].0"): keep the field path, and for
    # a value that matches no member say which types would do.
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param)
    tags = []  # the union members the value was tried against, in declaration order
    for err in e.errors(include_url=False):
        tag = next((p for p in err["loc"] if _is_union_tag(p)), None)
        if err["loc"][:1] == first["loc"][:1] and tag is not None and tag not in tags:
            tags.append(tag)
    if len(tags) > 1:
        return APIError(400, f"{param}: expected one of {', '.join(tags)}", param=param)
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "ContentPart"))


# Formatting ------------------------------------------------------------------------------------------------
def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _ranked(position: PositionLogprobs, chosen: int, top_n: int) -> list[tuple[int, Any]]:
    """The chosen token first, then the top-N by rank (the chosen one is not repeated)."""
    top = sorted(((t, lp) for t, lp in position.items() if t != chosen and lp.rank is not None and lp.rank <= top_n),
                 key=lambda item: item[1].rank)
    return [(chosen, position[chosen]), *top]


def _token_str(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


class _Formatter:
    """Turns a group's deltas into OpenAI choices, one choice per (prompt, completion): index = prompt * n + i."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, server: OpenAIServer, req: Any, request_id: str, group: RequestGroup) -> None:
        self.server, self.req, self.request_id, self.group = server, req, request_id, group
        self.n = req.n
        self.prompt_index = {p.request_id: i for i, p in enumerate(group.inputs)}
        self.num_choices = len(group.inputs) * self.n
        self.prompt_tokens = sum(len(p.prompt_token_ids) for p in group.inputs)
        self.completion_tokens = 0
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def choices_of(self, delta: RequestDelta) -> list[tuple[int, Any]]:
        base = self.prompt_index[delta.request_id] * self.n
        return [(base + c.index, c) for c in delta.completions]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object_name, "created": self.created,
                                "model": self.server.model_name, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return _sse(body)

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def stream(self) -> AsyncIterator[str]:
        try:
            for event in self.stream_start():
                yield event
            async for delta in self.group:
                for index, c in self.choices_of(delta):
                    self.completion_tokens += len(c.token_ids)
                    if c.text or c.finish_reason is not None or c.logprobs or self.server.tokenizer is None:
                        yield self.chunk([self.choice_delta(index, c)])
            if self.include_usage:
                yield self.chunk([], self.usage())
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield _sse(APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"

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
        self.completion_tokens = sum(len(a["token_ids"]) for a in acc)
        body = {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.server.model_name,
                "choices": [self.full_choice(i, a) for i, a in enumerate(acc)], "usage": self.usage()}
        return JSONResponse(body)

    def choice_delta(self, index: int, c: Any) -> dict[str, Any]:
        raise NotImplementedError

    def full_choice(self, index: int, acc: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormatter(_Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.text_offsets = [0] * self.num_choices

    def logprobs(self, index: int, token_ids: list[int], positions: list[PositionLogprobs]) -> dict | None:
        if self.req.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, position in zip(token_ids, positions):
            ranked = _ranked(position, tid, self.req.logprobs)
            token = _token_str(ranked[0][1])
            out["tokens"].append(token)
            out["token_logprobs"].append(_finite(ranked[0][1].logprob))
            top: dict[str, float] = {}
            for _, lp in ranked:  # tokens that decode alike (partial UTF-8) keep the first, most relevant entry
                top.setdefault(_token_str(lp), _finite(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offsets[index])
            self.text_offsets[index] += len(token)
        return out

    def choice_delta(self, index: int, c: Any) -> dict[str, Any]:
        return {"index": index, "text": c.text, "logprobs": self.logprobs(index, c.token_ids, c.logprobs or []),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, **self.token_ids(c.token_ids)}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "text": "".join(a["text"]),
                "logprobs": self.logprobs(index, a["token_ids"], a["logprobs"]),
                "finish_reason": a["finish_reason"], "stop_reason": a["stop_reason"], **self.token_ids(a["token_ids"])}

    def token_ids(self, ids: list[int]) -> dict[str, list[int]]:
        """A model without a tokenizer (random weights) has no text to send: its choices carry the token ids."""
        return {"token_ids": list(ids)} if self.server.tokenizer is None else {}


class _ChatFormatter(_Formatter):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        top_n = self.req.top_logprobs or 0
        content = []
        for tid, position in zip(token_ids, positions):
            ranked = _ranked(position, tid, top_n)
            chosen = ranked[0][1]
            top = sorted((lp for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
                         key=lambda lp: lp.rank)
            content.append({**_chat_token(chosen), "top_logprobs": [_chat_token(lp) for lp in top]})
        return {"content": content, "refusal": None}

    def stream_start(self) -> list[str]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.num_choices)]

    def choice_delta(self, index: int, c: Any) -> dict[str, Any]:
        delta = {"content": c.text} if c.text or c.finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": self.logprobs(c.token_ids, c.logprobs or []),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": "".join(a["text"]), "refusal": None,
                                            "tool_calls": []},
                "logprobs": self.logprobs(a["token_ids"], a["logprobs"]),
                "finish_reason": a["finish_reason"], "stop_reason": a["stop_reason"]}


def _chat_token(lp: Any) -> dict[str, Any]:
    token = _token_str(lp)
    return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode("utf-8"))}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _respond(request: Request, fmt: _Formatter) -> Response:
    """The formatted answer: streamed as SSE, or collected into one body; either way the group is aborted when
    the client goes away."""
    if fmt.req.stream:
        return _SSEResponse(fmt.stream(), on_close=fmt.group.abort)
    return await _until_disconnect(request, fmt.collect(), on_close=fmt.group.abort)


# Client disconnects ----------------------------------------------------------------------------------------
async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
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


async def _until_disconnect(request: Request, work: Awaitable[Response],
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


# The app ---------------------------------------------------------------------------------------------------
def build_app(engine: AsyncLLMEngine, *, served_model_name: str | None = None, api_key: str | None = None,
              metrics_public: bool = False, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app over `engine` (connected to its core when the app starts). `api_key` covers every route but
    `/health` (and `/metrics` when `metrics_public`). `/health` answers 503 once the engine core is gone."""
    server = OpenAIServer(engine, model_name=resolve_served_name(engine.info, served_model_name),
                          api_key=api_key, metrics_public=metrics_public)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.async_engine.start()
        try:
            yield
        finally:
            await server.async_engine.shutdown()
            server.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody is listening; not a server error

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
            return JSONResponse(APIError(404, message, code="unknown_url").body(), status_code=404)
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        body = APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.async_engine.is_running else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not server.metrics_public:
            server.check_auth(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.check_auth(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        server.check_auth(request)
        if model != server.model_name:
            raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
        return server.model_card()

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    return app


def startup_line(info: CoreInfo, model_name: str, url: str) -> str:
    """What `kiln serve` prints once loaded: the model, the target, the KV pool and the tokens it holds."""
    limits = info.limits
    kv_bytes, kv_blocks, block_size = info.kv_bytes, limits.num_blocks, limits.block_size
    return (f"kiln serve: model {model_name!r} ({info.arch or '?'}, {info.artifact}) on target {info.target} "
            f"({info.device}, engine core pid {info.pid}, {info.num_threads} threads); KV pool {kv_bytes} bytes "
            f"({kv_bytes / 2**30:.2f} GiB) = {kv_blocks} blocks x {block_size} tokens = {kv_blocks * block_size} "
            f"tokens; max_model_len {limits.max_model_len}; listening on {url}")


def engine_options(*, num_kv_blocks: int | None = None, prefix_cache: bool = True, speculative: str | None = None,
                   async_scheduling: bool | None = None, **more: Any) -> dict[str, Any]:
    """EngineCore keyword arguments from `kiln serve`'s options (only those set: the rest are the artifact's)."""
    options = {k: v for k, v in more.items() if v is not None}
    if num_kv_blocks is not None:
        options["num_kv_blocks"] = num_kv_blocks
    if not prefix_cache:
        options["prefix_cache"] = None
    if speculative is not None:
        options["speculative"] = speculative
    if async_scheduling is not None:
        options["async_scheduling"] = async_scheduling
    return options


def serve(artifact: str | Path, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = 1024, num_kv_blocks: int | None = None,
          log_level: str = "info", prefix_cache: bool = True, speculative: str | None = None,
          async_scheduling: bool | None = None, metrics_public: bool = False, num_threads: int | None = None,
          disaggregate: dict | None = None) -> int:
    """`kiln serve`: starts the engine core, then serves until interrupted (exit status 0) or until the core
    dies (every request in flight gets an error, then exit status 1). `prefix_cache=False` turns the
    artifact's prefix cache off (for A/B measurements); `speculative` ("mtp", "none") overrides the recipe's;
    `async_scheduling` (None: the recipe's, else on for CUDA) overlaps host work with the device;
    `metrics_public` leaves `/metrics` open when an `api_key` is set; `num_threads`: the core's intra-op
    threads (default: every CPU this process may use; threads.py). `disaggregate` (the manifest's section, see
    runtime/disagg): a router over one prefill and one decode core instead of one core."""
    import uvicorn

    threads.configure_api_server()
    config = CoreConfig(artifact=str(artifact), max_waiting=max_waiting, num_threads=num_threads,
                        engine=engine_options(num_kv_blocks=num_kv_blocks, prefix_cache=prefix_cache,
                                              speculative=speculative, async_scheduling=async_scheduling))
    with contextlib.ExitStack() as stack:
        if disaggregate is None:
            engine = AsyncLLMEngine.from_process(stack.enter_context(CoreProcess.start(config)))
        else:  # a router over a prefill and a decode core (runtime/disagg)
            from .disagg.service import start_disaggregated
            engine = start_disaggregated(stack, config, disaggregate)
        app = build_app(engine, served_model_name=served_model_name, api_key=api_key, metrics_public=metrics_public)
        print(startup_line(engine.info, app.state.server.model_name, f"http://{host}:{port}"), flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                               timeout_graceful_shutdown=5))
        engine.on_dead.append(lambda why: setattr(server, "should_exit", True))
        server.run()
    if engine.dead is not None:
        print(f"kiln serve: exiting: the engine core is gone ({engine.dead})", file=sys.stderr, flush=True)
        return 1
    return 0
