"""The OpenAI server's request handling, independent of routing (app.py routes to it): parse -> validate ->
tokenize -> submit -> format (formatters.py, streaming.py).

`kiln serve` runs two processes: this API server (HTTP, tokenization, chat templates, detokenization, stop
strings, SSE) and the engine core it starts and owns (scheduler, KV cache, model runner, sampler), which it
talks to over the engine-core protocol (ipc/protocol.py). The model never shares a GIL with HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..errors import KilnRuntimeError, RequestError
from ..grammar_spec import JSON_WHITESPACE, GrammarSpec
from ..ipc.protocol import CoreInfo
from ..sampling_params import SamplingParams
from ..thinking import effort_budgets
from ..tokenizer import token_text
from .async_engine import AsyncLLMEngine, PromptInput, RequestGroup
from .chat_plan import PlanError, RequestPlan, check_grammar, plan_chat, requested_grammar, resolve_parsers
from .chat_template import render_chat as render_template
from .formatters import ChatFormatter, CompletionFormatter, ResponsesFormatter
from .lora_api import LoRAAdapters
from .metrics import ServerMetrics
from .middleware import validation_error
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    request_error_param,
)
from .responses import ResponsesRequest, ResponseStore, as_responses_error, new_response_id
from .streaming import SSEResponse, respond, until_disconnect

_LONG_PROMPT_CHARS = 8192  # tokenized (chat templates: rendered) off the event loop beyond this
MAX_MESSAGES = 4096  # a chat (a response's history and input) longer than this is refused before rendering
GRAMMAR_CHECK_TIMEOUT_S = 5.0  # validating a response_format (off the loop) may take this long, else a 400
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
    `require_cache_salt`: a completion, chat or response request without a `cache_salt` is refused (400).
    `json_whitespace`: the whitespace JSON grammars allow (grammar_spec.JSON_WHITESPACE; `--json-whitespace`).
    """

    def __init__(self, engine: AsyncLLMEngine, *, model_name: str, api_key: str | None = None,
                 metrics_public: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, reasoning_efforts: dict[str, int] | None = None,
                 require_cache_salt: bool = False, json_whitespace: str = "compact") -> None:
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}, got {json_whitespace!r}")
        self.json_whitespace = json_whitespace
        self.model_name = model_name
        self.require_cache_salt = require_cache_salt  # `kiln serve --require-cache-salt`: multi-tenant
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
        self.grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-grammar-check")
        self.lora = LoRAAdapters(engine, model_name, self.model_card())  # `model` naming an adapter (lora_api.py)
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

    async def parse(self, request: Request, schema: type[_Req],
                    check_auth: Callable[[Request], None] | None = None) -> _Req:
        """Authenticates (`check_auth`, default the Bearer check), then reads the body (`BodyLimit` bounds its size
        and the time it may take). A big body costs the event loop one pass of JSON parsing in one go, nothing
        more: it is gathered as it arrives (no join at the end) and checked for UTF-8 only when the parse fails."""
        (check_auth or self.check_auth)(request)
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
            raise validation_error(e) from None
        if parsed.model is not None and parsed.model != self.model_name \
                and not await self.lora.exists(parsed.model):  # optional for /tokenize
            served = ", ".join(repr(m) for m in [self.model_name, *self.lora.adapters])
            raise APIError(404, f"The model {parsed.model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        parsed.check_supported()
        return parsed

    @staticmethod
    def check_num_messages(num_messages: int, param: str = "messages") -> None:
        """400 for more than MAX_MESSAGES messages, before anything is converted or rendered (a template's
        work grows with the messages, even empty ones)."""
        if num_messages > MAX_MESSAGES:
            raise APIError(400, f"the conversation has {num_messages} messages; at most {MAX_MESSAGES} are "
                           "accepted", param=param, code="too_many_messages")

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
        """The request's SamplingParams; a bad value is a 400 naming its field (a missing cache_salt too, on a
        server that requires one)."""
        if self.require_cache_salt and req.cache_salt is None:
            raise APIError(400, "this server requires a cache_salt on every request (it keys the prompt's "
                           "prefix-cache blocks to its tenant)", param="cache_salt")
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
        params = self.planned(params, RequestPlan(grammar=await self.grammar(req.response_format)))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = req.prompts()
        self.check_admissible(len(prompts), params, req)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.encode(texts) if texts else [])
        inputs = [PromptInput(f"{request_id}-{i}", next(encoded), p) if isinstance(p, str)
                  else PromptInput(f"{request_id}-{i}", p) for i, p in enumerate(prompts)]
        group = await self.submit(inputs, params, req)
        return await respond(request, CompletionFormatter(self, req, request_id, group))

    # /v1/chat/completions ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        params = self.engine_params(req)
        self.check_admissible(1, params, req)
        text = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                      tools=req.tools)
        params, plan = self.plan_chat_request(req, text, params, await self.grammar(req.response_format))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [ids] = await self.encode([text], add_special_tokens=False, param="messages")
        group = await self.submit([PromptInput(request_id, ids, text)], params, req)
        return await respond(request, ChatFormatter(self, req, request_id, group, plan))

    async def grammar(self, response_format: dict | None) -> GrammarSpec | None:
        """`response_format`'s grammar, validated on `grammar_pool` (seconds for a big schema: never on the event
        loop) within GRAMMAR_CHECK_TIMEOUT_S; an oversized, invalid or too slow one is a 400."""
        try:
            spec = requested_grammar(response_format, self.json_whitespace)
            if spec is not None:
                work = asyncio.get_running_loop().run_in_executor(self.grammar_pool, check_grammar, spec)
                await asyncio.wait_for(work, GRAMMAR_CHECK_TIMEOUT_S)
        except PlanError as e:
            raise APIError(400, str(e), param=e.param) from None
        except TimeoutError:
            raise APIError(400, f"validating response_format took longer than {GRAMMAR_CHECK_TIMEOUT_S:g} s; "
                           "simplify the schema", param="response_format") from None
        return spec

    def plan_chat_request(self, req: ChatCompletionRequest, text: str, params: SamplingParams,
                          grammar: GrammarSpec | None) -> tuple[SamplingParams, RequestPlan]:
        """response_format (`grammar`, validated), tools and thinking (chat_plan.py) as the request's grammar
        and thinking budget."""
        try:
            plan = plan_chat(req, text, self.tokenizer, self.tool_parser, self.reasoning_parser,
                             self.reasoning_efforts, grammar=grammar, json_whitespace=self.json_whitespace)
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
        self.check_num_messages(len(chat), param)
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
            return SSEResponse(fmt.events(), on_close=fmt.group.abort)
        return await until_disconnect(request, fmt.collect(), on_close=fmt.group.abort)

    async def submit_response(self, rreq: ResponsesRequest) -> ResponsesFormatter:
        history: list[dict[str, Any]] = []
        if rreq.previous_response_id is not None:
            previous = self.responses.get(rreq.previous_response_id)
            if previous is None:
                raise APIError(404, f"Previous response with id {rreq.previous_response_id!r} not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.messages
        self.check_num_messages(len(history) + (len(rreq.input) if isinstance(rreq.input, list) else 1))
        req = rreq.chat_request(history)
        params = self.engine_params(req)
        self.check_admissible(1, params, req)
        text = await self.render_chat(req.messages, True, None)
        params, plan = self.plan_chat_request(req, text, params, await self.grammar(req.response_format))
        response_id = new_response_id()
        [ids] = await self.encode([text], add_special_tokens=False, param="messages")
        group = await self.submit([PromptInput(response_id, ids, text)], params, req)
        return ResponsesFormatter(self, req, response_id, group, rreq, history + rreq.input_messages(), plan)

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
