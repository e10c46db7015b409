"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, SSE streaming, Prometheus metrics.

`kiln serve` runs two processes: this API server (HTTP, tokenization, chat templates, detokenization, stop
strings, SSE) and the engine core it starts and owns (scheduler, KV cache, model runner, sampler), which it
talks to over the engine-core protocol (ipc/protocol.py). The model never shares a GIL with HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import threads
from ..errors import KilnRuntimeError, RequestError
from ..ipc.client import CoreProcess
from ..ipc.protocol import CoreConfig, CoreInfo
from ..outputs import CompletionDelta, PositionLogprobs, RequestDelta
from ..sampling_params import SamplingParams
from ..tokenizer import token_text
from .async_engine import AsyncLLMEngine, PromptInput, RequestGroup
from .chat_plan import ChoiceParser, PlanError, RequestPlan, plan_chat, resolve_parsers, validated_grammar
from .lora_api import LoRAAdapters, add_lora_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    request_error_param,
)
from .reasoning_parsers import effort_budgets
from .responses import (
    ResponsesRequest,
    ResponseStore,
    as_responses_error,
    final_status,
    message_item,
    new_response_id,
    output_text_part,
    reasoning_item,
    response_object,
    usage_object,
)
from .tool_parsers import render_chat as render_template

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

    `tool_parser` / `reasoning_parser`: registry names (or "none") overriding what the chat template implies
    (chat_plan.resolve_parsers); they turn `tools` into `tool_calls` and thinking into `reasoning_content`.
    `reasoning_efforts`: reasoning_effort -> thinking budget entries over reasoning_parsers.EFFORT_BUDGETS.
    """

    def __init__(self, engine: AsyncLLMEngine, *, model_name: str, api_key: str | None = None,
                 metrics_public: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, reasoning_efforts: dict[str, int] | None = None) -> None:
        self.model_name = model_name
        self.api_key = api_key
        self.metrics_public = metrics_public
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.limits.max_model_len
        self.max_prompt_chars = self.max_model_len * _longest_token_chars(engine.tokenizer)
        self.metrics = ServerMetrics(model_name, lambda: self.async_engine.stats, engine.info.limits.block_size,
                                     engine.info.speculative)
        for collector in getattr(engine, "metrics_collectors", ()):  # a disaggregated router's (runtime/disagg)
            self.metrics.registry.register(collector)
        self.async_engine = engine
        engine.observer = self.metrics
        self.created = int(time.time())
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-tokenize")
        self.lora = LoRAAdapters(self)  # `model` naming a LoRA adapter (lora_api.py)
        self.tool_parser, self.reasoning_parser = resolve_parsers(engine.tokenizer, tool_parser, reasoning_parser)
        self.reasoning_efforts = effort_budgets(reasoning_efforts)
        self.responses = ResponseStore()

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
        if parsed.model is not None and parsed.model != self.model_name \
                and not await self.lora.exists(parsed.model):  # optional for /tokenize
            served = ", ".join(repr(m) for m in [self.model_name, *self.lora.adapters])
            raise APIError(404, f"The model {parsed.model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
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

    def engine_params(self, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        """The request's SamplingParams; a bad value is a 400 naming its field."""
        try:
            return req.engine_params()
        except RequestError as e:
            raise APIError(400, str(e), param=request_error_param(e, set(type(req).model_fields))) from None

    @staticmethod
    def planned(params: SamplingParams, plan: RequestPlan) -> SamplingParams:
        fields = plan.sampling_fields()
        return dataclasses.replace(params, **fields) if fields else params

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
            return await self.async_engine.add_requests(inputs, params, self.lora.lora_name(req.model))
        except RequestError as e:
            param = request_error_param(e, set(type(req).model_fields)) or prompt_param
            raise APIError(400, str(e), param=param) from None
        except KilnRuntimeError as e:  # overloaded, or the engine core is gone
            raise APIError(503, str(e), type="server_error", code="overloaded") from None

    # /v1/completions ---------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        params = self.engine_params(req)
        try:
            plan = RequestPlan(grammar=validated_grammar(req.response_format))
        except PlanError as e:
            raise APIError(400, str(e), param=e.param) from None
        params = self.planned(params, plan)
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
        params = self.engine_params(req)
        self.check_admissible(1, params, req)
        text = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                      tools=req.tools)
        params, plan = self.plan_chat_request(req, text, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [ids] = await self.encode([text], add_special_tokens=False, param="messages")
        group = await self.submit([PromptInput(request_id, ids, text)], params, req)
        return await _respond(request, _ChatFormatter(self, req, request_id, group, plan))

    def plan_chat_request(self, req: ChatCompletionRequest, text: str,
                          params: SamplingParams) -> tuple[SamplingParams, RequestPlan]:
        """response_format, tools and thinking (chat_plan.py) as the request's grammar and thinking budget."""
        try:
            plan = plan_chat(req, text, self.tokenizer, self.tool_parser, self.reasoning_parser,
                             self.reasoning_efforts)
        except PlanError as e:
            raise APIError(400, str(e), param=e.param) from None
        return self.planned(params, plan), plan

    async def render_chat(self, chat: list[ChatMessage], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None, continue_final_message: bool = False,
                          param: str = "messages", tools: list | None = None) -> str:
        """The chat template's text for `chat`; a template that rejects the messages is a 400. With
        `continue_final_message` the text ends where the last message's content does (the model goes on with
        it, as transformers does it)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions with "
                           "token ids", param=param)
        messages = [m.for_template(i) for i, m in enumerate(chat)]
        num_chars = sum(len(m["content"]) for m in messages)  # a template adds to the text, never cuts it
        self.check_prompt_chars(num_chars, param)

        def render() -> str:
            return render_template(self.tokenizer, messages, tools, parser=self.tool_parser,
                                   add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        try:
            text = render() if num_chars <= _LONG_PROMPT_CHARS else await self.off_loop(render)
        except RequestError as e:
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # the template raised on these messages (raise_exception, ...)
            raise APIError(400, f"the chat template rejected the messages: {type(e).__name__}: {e}",
                           param=param) from None
        if continue_final_message:
            final = messages[-1]["content"].strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise APIError(400, "continue_final_message: the rendered template does not contain the final "
                               "message's content", param="continue_final_message")
            text = text[:at + len(final)]
        return text

    # /v1/responses ----------------------------------------------------------------------------------------
    async def create_response(self, request: Request) -> Response:
        rreq = await self.parse(request, ResponsesRequest)
        try:
            fmt = await self.submit_response(rreq)
        except APIError as e:  # about the chat request it is served as: name the Responses field
            raise as_responses_error(e) from None
        if rreq.stream:
            return _SSEResponse(fmt.events(), on_close=fmt.group.abort)
        return await _until_disconnect(request, fmt.collect(), on_close=fmt.group.abort)

    async def submit_response(self, rreq: ResponsesRequest) -> _ResponsesFormatter:
        history: list[dict[str, Any]] = []
        if rreq.previous_response_id is not None:
            previous = self.responses.get(rreq.previous_response_id)
            if previous is None:
                raise APIError(404, f"Previous response with id {rreq.previous_response_id!r} not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.messages
        req = rreq.chat_request(history)
        params = self.engine_params(req)
        self.check_admissible(1, params, req)
        text = await self.render_chat(req.messages, True, None)
        params, plan = self.plan_chat_request(req, text, params)  # text.format is chat's response_format
        response_id = new_response_id()
        [ids] = await self.encode([text], add_special_tokens=False, param="messages")
        group = await self.submit([PromptInput(response_id, ids, text)], params, req)
        return _ResponsesFormatter(self, req, response_id, group, rreq, history + rreq.input_messages(), plan)

    async def stored_response(self, request: Request, response_id: str) -> dict[str, Any]:
        self.check_auth(request)
        item = self.responses.get(response_id)
        if item is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id",
                           code="response_not_found")
        return item.response

    async def delete_response(self, request: Request, response_id: str) -> dict[str, Any]:
        self.check_auth(request)
        if not self.responses.delete(response_id):
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id",
                           code="response_not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    # /tokenize, /detokenize (vLLM's) ---------------------------------------------------------------------
    async def tokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse(request, TokenizeRequest)
        if req.messages is not None:
            text = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                          req.continue_final_message)
            add_special = bool(req.add_special_tokens)
        else:
            text, add_special = req.prompt, req.add_special_tokens is not False
        [ids] = await self.encode([text], add_special_tokens=add_special,
                                  param="prompt" if req.messages is None else "messages")
        strs = [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse(request, DetokenizeRequest)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.async_engine.info.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad}", param="tokens")
        if len(req.tokens) > self.max_model_len:
            raise APIError(400, f"at most max_model_len ({self.max_model_len}) tokens, got {len(req.tokens)}",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def tokenizer_info(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's configuration (special tokens, chat template), which is what
        lm-eval's remote tokenizer reads (with /tokenize and /detokenize, it then needs no local copy)."""
        self.check_auth(request)
        if self.tokenizer is None:
            raise APIError(404, "this model has no tokenizer", code="no_tokenizer")
        tok = self.tokenizer
        info = {k: token_text(v) if k.endswith("_token") else v for k, v in tok.config.items()
                if k != "added_tokens_decoder"}
        info.update(tokenizer_class=tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
                    bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template,
                    model_max_length=self.max_model_len, vocab_size=tok.vocab_size)
        info.setdefault("pad_token", None)
        return info

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


def _merge(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    """`a` then `b`, one completion's consecutive deltas, as one."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or []), *(b.logprobs or [])]
    return CompletionDelta(a.index, a.text + b.text, a.token_ids + b.token_ids, logprobs,
                           b.finish_reason or a.finish_reason, b.stop_reason if b.finish_reason else a.stop_reason)


def _token_str(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


class _Formatter:
    """Turns a group's deltas into OpenAI choices, one choice per (prompt, completion): index = prompt * n + i.
    The engine runs `num_seqs` completions per prompt (more than n for best_of); `select` picks the n shown."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, server: OpenAIServer, req: Any, request_id: str, group: RequestGroup,
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
        return _sse(body)

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
                        merged[index] = c if index not in merged else _merge(merged[index], c)
                for index, c in merged.items():
                    for choice in self.stream_choices(index, c):
                        yield self.chunk([choice])
            if self.include_usage:
                yield self.chunk([], self.usage())
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield _sse(APIError(500, str(e), type="server_error").body())
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


class _CompletionFormatter(_Formatter):
    """`echo` puts the prompt's text before each choice's text, and with `logprobs` its tokens before the
    generated ones: the first prompt token's logprob and top logprobs are null (it has no context), offsets
    count from the start of the echoed text. `max_tokens: 0` (with echo) shows the prompt alone: the one token
    the engine generated for it is dropped. Streamed, a choice's first chunk carries the echo; with logprobs it
    waits until the prompt's logprobs are all in (they arrive with the prefill, chunk by chunk)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.text_offsets = [0] * self.num_choices
        self.echo_only = self.req.max_tokens == 0
        self.echo_pending = [self.req.echo] * self.num_choices  # streaming: the echo is still to be sent
        self.held: list[list[Any]] = [[] for _ in range(self.num_choices)]

    # Echo --------------------------------------------------------------------------------------------------
    def prompt_text(self, prompt: int) -> str:
        p = self.group.inputs[prompt]
        if p.prompt is not None:
            return p.prompt
        tok = self.server.tokenizer
        return tok.decode(p.prompt_token_ids, skip_special_tokens=False) if tok is not None else ""

    def prompt_complete(self, prompt: int) -> bool:
        return self.req.logprobs is None or \
            len(self.prompt_logprobs[prompt]) == len(self.group.inputs[prompt].prompt_token_ids)

    def shown(self, c_text: str, token_ids: list[int], logprobs: list | None) -> tuple[str, list[int], list]:
        """What of a completion's output is shown: nothing of it for max_tokens 0."""
        return ("", [], []) if self.echo_only else (c_text, token_ids, logprobs or [])

    # Logprobs ----------------------------------------------------------------------------------------------
    def logprobs(self, index: int, token_ids: list[int], positions: list[PositionLogprobs],
                 prompt: int | None = None) -> dict | None:
        """OpenAI's logprobs object of `token_ids`, preceded by prompt `prompt`'s tokens when echoed."""
        if self.req.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:
            ids = self.group.inputs[prompt].prompt_token_ids
            for tid, position in zip(ids, self.prompt_logprobs[prompt], strict=True):
                self._add_logprob(out, index, tid, position)
        for tid, position in zip(token_ids, positions):
            self._add_logprob(out, index, tid, position)
        return out

    def _add_logprob(self, out: dict[str, list], index: int, tid: int, position: PositionLogprobs | None) -> None:
        if position is None:  # the prompt's first token: no context, no logprob
            tok = self.server.tokenizer
            token = tok.decode_piece(tid, False) if tok is not None else ""
            out["tokens"].append(token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
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

    # Choices -----------------------------------------------------------------------------------------------
    def stream_choices(self, index: int, c: Any) -> list[dict[str, Any]]:
        prompt = index // self.num_seqs
        if self.echo_pending[index] and not self.prompt_complete(prompt):
            self.held[index].append(c)  # until the prompt's logprobs are all in
            return []
        held, self.held[index] = self.held[index], []
        choices = []
        for d in (*held, c):
            if not self.echo_only:
                self.completion_tokens += len(d.token_ids)
            if self.echo_pending[index] or d.finish_reason is not None or \
                    (not self.echo_only and (d.text or d.logprobs or (self.server.tokenizer is None and d.token_ids))):
                choices.append(self.choice_delta(index, d))
        return choices

    def choice_delta(self, index: int, c: Any) -> dict[str, Any]:
        text, ids, lps = self.shown(c.text, c.token_ids, c.logprobs)
        prompt = None
        if self.echo_pending[index]:
            self.echo_pending[index] = False
            prompt = index // self.num_seqs
            text = self.prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": self.logprobs(index, ids, lps, prompt),
                "finish_reason": "length" if self.echo_only and c.finish_reason is not None else c.finish_reason,
                "stop_reason": None if self.echo_only else c.stop_reason, **self.token_ids(ids)}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        text, ids, lps = self.shown("".join(a["text"]), a["token_ids"], a["logprobs"])
        prompt = a["prompt"] if self.req.echo else None
        if prompt is not None:
            text = self.prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": self.logprobs(index, ids, lps, prompt),
                "finish_reason": "length" if self.echo_only else a["finish_reason"],
                "stop_reason": None if self.echo_only else a["stop_reason"], **self.token_ids(ids)}

    def num_generated(self, a: dict[str, Any]) -> int:
        return 0 if self.echo_only else len(a["token_ids"])

    def token_ids(self, ids: list[int]) -> dict[str, list[int]]:
        """A model without a tokenizer (random weights) has no text to send: its choices carry the token ids."""
        return {"token_ids": list(ids)} if self.server.tokenizer is None else {}


class _ChatFormatter(_Formatter):
    """Chat choices: the text split by the plan's parsers into `reasoning_content`, `content` and `tool_calls`
    (finish_reason "tool_calls" when the output ended with calls); streamed, each as deltas."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.parsers: list[ChoiceParser] = [self.plan.choice_parser() for _ in range(self.num_choices)]

    @staticmethod
    def finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

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

    def choice_delta(self, index: int, c: Any) -> dict[str, Any] | None:
        parser, final = self.parsers[index], c.finish_reason is not None
        out = parser.feed(c.text, final)
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = out.tool_calls
        logprobs = self.logprobs(c.token_ids, c.logprobs or [])
        if not (delta or final or logprobs):
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": self.finish_reason(c.finish_reason, parser.has_tool_calls), "stop_reason": c.stop_reason}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        out = self.parsers[index].parse("".join(a["text"]))
        message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None,
                                   "tool_calls": out.tool_calls}
        if self.plan.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.content is None and not out.tool_calls:
            message["content"] = ""
        return {"index": index, "message": message, "logprobs": self.logprobs(a["token_ids"], a["logprobs"]),
                "finish_reason": self.finish_reason(a["finish_reason"], bool(out.tool_calls)), "stop_reason": a["stop_reason"]}


class _ResponsesFormatter(_ChatFormatter):
    """A chat completion's deltas as a Responses API response: one output message of one output_text part, after
    a `reasoning` item when a reasoning model thought; streamed as the Responses event sequence (created,
    in_progress, [output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done for the
    reasoning,] output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
    output_item.done, then completed, incomplete or failed). The final response is stored (unless `store` is
    false) with the conversation it ends (the answer, not the thinking)."""

    def __init__(self, server: OpenAIServer, req: ChatCompletionRequest, response_id: str, group: RequestGroup,
                 rreq: ResponsesRequest, messages: list[dict[str, Any]], plan: RequestPlan | None = None) -> None:
        super().__init__(server, req, response_id, group, plan)
        self.rreq, self.messages = rreq, messages
        self.item_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.sequence_number = 0

    def response(self, status: str, text: str = "", logprobs: list | None = None, error: str | None = None,
                 reasoning: str | None = None) -> dict[str, Any]:
        done = status != "in_progress"
        output = []
        if done and error is None:
            item_status = "completed" if status == "completed" else "incomplete"
            if reasoning is not None:
                output.append(reasoning_item(self.reasoning_id, reasoning, item_status))
            output.append(message_item(self.item_id, text, item_status, logprobs))
        usage = usage_object(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens or 0) if done else None
        return response_object(self.request_id, self.rreq, self.created, status=status, output=output,
                               usage=usage, error=error)

    def finish(self, text: str, token_ids: list[int], positions: list[PositionLogprobs],
               finish_reason: str | None, error: str | None) -> dict[str, Any]:
        self.completion_tokens = len(token_ids)
        if error is None:
            self.count_reasoning(token_ids)
        out = self.parsers[0].parse(text)
        logprobs = self.logprobs(token_ids, positions)
        body = self.response(final_status(finish_reason, error), out.content or "",
                             logprobs["content"] if logprobs is not None else None, error, out.reasoning)
        if self.rreq.store and error is None:
            self.server.responses.put(body, [*self.messages, {"role": "assistant", "content": out.content or ""}])
        return body

    async def collect(self) -> Response:
        text, token_ids, positions, finish_reason = [], [], [], None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    text.append(c.text)
                    token_ids += c.token_ids
                    positions += c.logprobs or []
                    finish_reason = c.finish_reason or finish_reason
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        return JSONResponse(self.finish("".join(text), token_ids, positions, finish_reason, None))

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {_json_encode(body).decode()}\n\n"

    def open_message(self, index: int) -> list[str]:
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item(self.item_id, "", "in_progress", None)),
                self.event("response.content_part.added", **where, part=output_text_part("", None))]

    def begin_message(self, reasoning: list[str] | None) -> tuple[int, list[str]]:
        """The message's output index and the events that end the reasoning item (if one began) and open it."""
        if reasoning is None:
            return 0, self.open_message(0)
        text, where = "".join(reasoning), {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return 1, [self.event("response.reasoning_text.done", **where, text=text),
                   self.event("response.output_item.done", output_index=0,
                              item=reasoning_item(self.reasoning_id, text, "completed")), *self.open_message(1)]

    async def events(self) -> AsyncIterator[str]:
        start = self.response("in_progress")
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        parser = self.parsers[0] if self.plan.reasoning is not None else None
        message_at = None  # the message's output index, once it is open: at once when the model does not think
        if parser is None:
            message_at, opening = self.begin_message(None)
            for e in opening:
                yield e
        reasoning: list[str] | None = None  # the thinking streamed so far, once it has begun
        text, token_ids, positions, finish_reason = [], [], [], None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    token_ids += c.token_ids
                    positions += c.logprobs or []
                    finish_reason = c.finish_reason or finish_reason
                    text.append(c.text)
                    out = parser.feed(c.text, c.finish_reason is not None) if parser is not None else None
                    thought, content = (out.reasoning, out.content) if out is not None else (None, c.text)
                    if thought and message_at is None:
                        if reasoning is None:
                            reasoning = []
                            yield self.event("response.output_item.added", output_index=0,
                                             item=reasoning_item(self.reasoning_id, "", "in_progress"))
                        reasoning.append(thought)
                        yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                         output_index=0, content_index=0, delta=thought)
                    if content:
                        if message_at is None:
                            message_at, opening = self.begin_message(reasoning)
                            for e in opening:
                                yield e
                        logprobs = self.logprobs(c.token_ids, c.logprobs or [])
                        yield self.event("response.output_text.delta", item_id=self.item_id, output_index=message_at,
                                         content_index=0, delta=content,
                                         logprobs=logprobs["content"] if logprobs is not None else [])
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield self.event("response.failed", response=self.finish("", [], [], None, str(e)))
            return
        body = self.finish("".join(text), token_ids, positions, finish_reason, None)
        if message_at is None:  # no answer: the thinking ends here, then an empty message
            message_at, opening = self.begin_message(reasoning)
            for e in opening:
                yield e
        message = body["output"][-1]
        part, where = message["content"][0], {"item_id": self.item_id, "output_index": message_at, "content_index": 0}
        yield self.event("response.output_text.done", **where, text=part["text"], logprobs=part.get("logprobs", []))
        yield self.event("response.content_part.done", **where, part=part)
        yield self.event("response.output_item.done", output_index=message_at, item=message)
        yield self.event(f"response.{body['status']}", response=body)


def _chat_token(lp: Any) -> dict[str, Any]:
    token = _token_str(lp)
    return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode("utf-8"))}


_json_encode = msgspec.json.Encoder().encode


def _sse(body: dict[str, Any]) -> bytes:
    """One server-sent event. msgspec's JSON encoder: compact, UTF-8 unescaped, several times json.dumps' speed
    (an event per token per stream is the server's hottest path); non-finite floats never get here (_finite)."""
    return b"data: " + _json_encode(body) + b"\n\n"


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
              body_timeout: float = BODY_TIMEOUT_S, tool_parser: str | None = None,
              reasoning_parser: str | None = None, reasoning_efforts: dict[str, int] | None = None) -> FastAPI:
    """The app over `engine` (connected to its core when the app starts). `api_key` covers every route but
    `/health` (and `/metrics` when `metrics_public`). `/health` answers 503 once the engine core is gone."""
    server = OpenAIServer(engine, model_name=resolve_served_name(engine.info, served_model_name),
                          api_key=api_key, metrics_public=metrics_public, tool_parser=tool_parser,
                          reasoning_parser=reasoning_parser, reasoning_efforts=reasoning_efforts)

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
        await server.lora.refresh()
        return {"object": "list", "data": [server.model_card(), *server.lora.cards()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        server.check_auth(request)
        if model != server.model_name:
            if not await server.lora.exists(model):
                raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
            return next(c for c in server.lora.cards() if c["id"] == model)
        return server.model_card()

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    add_lora_routes(app, server)
    app.add_api_route("/v1/responses", server.create_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", server.stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", server.delete_response, methods=["DELETE"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])
    return app


def startup_line(info: CoreInfo, model_name: str, url: str) -> str:
    """What `kiln serve` prints once loaded: the model, the target, the KV pool and the tokens it holds."""
    limits = info.limits
    kv_bytes, kv_blocks, block_size = info.kv_bytes, limits.num_blocks, limits.block_size
    return (f"kiln serve: model {model_name!r} ({info.arch or '?'}, {info.artifact}) on target {info.target} "
            f"({info.device}, engine core pid {info.pid}, {info.num_threads} threads"
            + (f" on CPUs {threads.format_cpu_list(info.cpus)}" if info.cpus else "") + f"); KV pool {kv_bytes} bytes "
            f"({kv_bytes / 2**30:.2f} GiB) = {kv_blocks} blocks x {block_size} tokens = {kv_blocks * block_size} "
            f"tokens; max_model_len {limits.max_model_len}; {info.max_seqs} sequences and {info.max_batched_tokens} "
            f"tokens a step; listening on {url}")


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


def core_config(artifact: str | Path, *, max_waiting: int = 1024, num_threads: int | None = None,
                stream_interval: int = 1, cpus: list[int] | None = None, **options: Any) -> CoreConfig:
    """The engine core's configuration for `kiln serve`'s options (engine_options). `cpus` (`--core-cpus`) are
    checked here: every one must be a CPU this process may run on (RequestError, a user's error, if not)."""
    if cpus is not None:
        try:
            threads.check_cpus(cpus)
        except ValueError as e:
            raise RequestError(str(e)) from None
    return CoreConfig(artifact=str(artifact), max_waiting=max_waiting, num_threads=num_threads, cpus=cpus,
                      stream_interval=stream_interval, engine=engine_options(**options))


def serve(artifact: str | Path, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = 1024, num_kv_blocks: int | None = None,
          log_level: str = "info", prefix_cache: bool = True, speculative: str | None = None,
          async_scheduling: bool | None = None, kv_reserve: str | None = None, metrics_public: bool = False,
          num_threads: int | None = None, tool_parser: str | None = None, reasoning_parser: str | None = None,
          reasoning_efforts: dict[str, int] | None = None, disaggregate: dict | None = None, replicas: int = 1,
          router_policy: str = "kv", num_speculative_tokens: int | None = None,
          speculative_model: str | None = None, kv_offload: int | None = None, stream_interval: int = 1,
          core_cpus: list[int] | None = None, max_num_seqs: int | None = None,
          max_num_batched_tokens: int | None = None) -> int:
    """`kiln serve`: starts the engine core, then serves until interrupted (exit status 0) or until the core
    dies (every request in flight gets an error, then exit status 1). `prefix_cache=False` turns the
    artifact's prefix cache off (for A/B measurements); `speculative` ("mtp", "ngram", "draft" with
    `speculative_model`, "none"; `num_speculative_tokens` a step) overrides the recipe's;
    `async_scheduling` (None: the recipe's, else on for CUDA) overlaps host work with the device; `kv_reserve`
    (None: the recipe's) says which requests are admitted only with KV for their whole budget (scheduler.py);
    `metrics_public` leaves `/metrics` open when an `api_key` is set; `num_threads`: the core's intra-op
    threads (default: every CPU this process may use; threads.py); `tool_parser` / `reasoning_parser` /
    `reasoning_efforts`: see OpenAIServer. `disaggregate` (the manifest's section, see runtime/disagg): a router
    over one prefill and one decode core instead of one core. `replicas` > 1 (`--data-parallel-size`): that many
    replicas (cores, each with its own ranks for a parallel artifact, or pairs) behind a KV-aware router
    (runtime/disagg/router.py; `router_policy` "round_robin" for A/B measurements). `kv_offload`: bytes of the CPU
    offload tier (None: the recipe's; 0: none; runtime/core/kv_offload.py). `stream_interval`: a stream's tokens are
    sent every that many (its first and last at once; core_process.StreamCoalescer). `core_cpus`
    (`--core-cpus`): the CPUs the engine core computes on (several cores: disjoint slices of them); this process,
    the API server, then runs on the CPUs it may use that they were not given (threads.py). `max_num_seqs` /
    `max_num_batched_tokens` (None: the recipe's scheduler section) bound the sequences running at once and the
    tokens of a step."""

    resolve_parsers(None, tool_parser, reasoning_parser)  # an unknown name fails before the core is started
    effort_budgets(reasoning_efforts)  # so does a bad effort table
    threads.configure_api_server()
    config = core_config(artifact, max_waiting=max_waiting, num_threads=num_threads, stream_interval=stream_interval,
                         cpus=core_cpus, num_kv_blocks=num_kv_blocks, prefix_cache=prefix_cache, speculative=speculative, async_scheduling=async_scheduling,
                         kv_reserve=kv_reserve, num_speculative_tokens=num_speculative_tokens,
                         speculative_model=speculative_model, kv_offload_bytes=kv_offload, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
    with contextlib.ExitStack() as stack:
        if replicas > 1:  # a KV-aware router over several replicas (runtime/disagg/router.py)
            from ..disagg.router import start_replicas
            engine = start_replicas(stack, config, replicas, disaggregate, policy=router_policy)
        elif disaggregate is None:
            engine = AsyncLLMEngine.from_process(stack.enter_context(CoreProcess.start(config)))
        else:  # a router over a prefill and a decode core (runtime/disagg)
            from ..disagg.service import start_disaggregated
            engine = start_disaggregated(stack, config, disaggregate)
        more = []
        api_cpus = threads.place_api_server(core_cpus)  # after the cores started: they inherited the full mask
        if api_cpus:
            more.append(f"kiln serve: the API server runs on CPUs {threads.format_cpu_list(api_cpus)}")
        if replicas > 1:
            pids = ", ".join(str(r.engine.info.pid) for r in engine.replicas)
            more.append(f"kiln serve: {replicas} replicas behind a KV-aware router (engine core pids {pids}; the "
                        "line above is replica 0's)")
        return run_app(engine, host=host, port=port, log_level=log_level, more_lines=more,
                       served_model_name=served_model_name, api_key=api_key, metrics_public=metrics_public,
                       tool_parser=tool_parser, reasoning_parser=reasoning_parser, reasoning_efforts=reasoning_efforts)


def run_app(engine: AsyncLLMEngine, *, host: str, port: int, log_level: str = "info", more_lines: list[str] = (),
            **app_kw: Any) -> int:
    """Serves `engine` (build_app's `app_kw`) on host:port until interrupted (0) or until its core is gone (1);
    prints the startup line (and `more_lines`) once loaded. `kiln serve` and `kiln router` (runtime/disagg)."""
    import uvicorn

    app = build_app(engine, **app_kw)
    print(startup_line(engine.info, app.state.server.model_name, f"http://{host}:{port}"), flush=True)
    for line in more_lines:
        print(line, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    engine.on_dead.append(lambda why: setattr(server, "should_exit", True))
    server.run()
    if engine.dead is not None:
        print(f"kiln serve: exiting: the engine core is gone ({engine.dead})", file=sys.stderr, flush=True)
        return 1
    return 0
