"""The OpenAI Responses API (`/v1/responses`): its request schema, how a request becomes the chat conversation the
chat-completions path serves, the response object and stream events, and the bounded store behind
`previous_response_id` and retrieve / delete by id.

A request is served as a chat completion: `instructions` (a system message, not carried to later turns, as
OpenAI does), the stored conversation of `previous_response_id`, then `input`, rendered by the chat template;
`max_output_tokens`, `temperature`, `top_p`, `text.format` and `reasoning.effort` become the chat request's
`max_completion_tokens`, `temperature`, `top_p`, `response_format` and `reasoning_effort`, so constrained decoding,
sampling and thinking budgets go through the one code path chat completions use. A reasoning model's thinking
comes back as a `reasoning` output item (its text as `reasoning_text` content; kiln writes no summaries) before
the message, streamed as `response.reasoning_text.delta` events.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from .protocol import MAX_LOGPROBS, APIError, ChatCompletionRequest, StrictModel, not_supported

# The store keeps the newest responses up to both bounds (least recently used evicted first): a count, and the
# characters of their conversations (each turn holds all the turns before it).
MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 2**20
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text", "output_text", "text"}


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(StrictModel):
    effort: str | None = None  # a thinking budget, as chat completions' reasoning_effort (the server's table)
    summary: str | None = None  # accepted; kiln returns the reasoning text itself and no summary
    generate_summary: str | None = None  # summary's deprecated name


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool = False


class ResponsesRequest(StrictModel):
    """What kiln serves of POST /v1/responses; the rest of OpenAI's fields are refused by name (400)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningOptions | None = None
    background: bool | None = None
    cache_salt: str | None = None  # vLLM's extension, as on chat completions

    def check_supported(self) -> None:
        if self.tools:
            raise not_supported("tools", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise not_supported("tool_choice", "tool_choice")
        if self.background:
            raise not_supported("background", "background mode")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        for i, item in enumerate(self.include or ()):
            if item != "message.output_text.logprobs":
                raise not_supported(f"include.{i}", f"include {item!r:.80}")
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "input must not be an empty list", param="input")

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` in the form chat completions' `response_format` takes."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        if fmt.description is not None:
            schema["description"] = fmt.description
        return {"type": "json_schema", "json_schema": schema}

    @property
    def reasoning_effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (role, text content). Reasoning items (an earlier response's output sent back)
        are left out: a turn's thinking is not shown to the next one, as the templates of reasoning models drop
        it; other items that are not text messages are refused."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [_input_message(i, item) for i, item in enumerate(self.input) if item.get("type") != "reasoning"]

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this response is served as (`history`: the previous turns' messages)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body: dict[str, Any] = {
            "model": self.model, "messages": messages + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "response_format": self.response_format(), "user": self.user,
            "reasoning_effort": self.reasoning_effort, "cache_salt": self.cache_salt}
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        req = ChatCompletionRequest.model_validate(body)
        req.check_supported()
        return req


_CHAT_TO_RESPONSES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                      "max_tokens": "max_output_tokens", "messages": "input", "reasoning_effort": "reasoning.effort"}


def as_responses_error(e: APIError) -> APIError:
    """An error about the chat request a response is served as, naming the Responses field it came from."""
    param = _CHAT_TO_RESPONSES.get(e.param or "", e.param)
    message = e.message
    for chat, responses in _CHAT_TO_RESPONSES.items():
        message = message.replace(chat, responses)
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


def _input_message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    where = f"input.{index}"
    kind = item.get("type", "message")
    if kind != "message":
        raise not_supported(f"{where}.type", f"input items of type {kind!r:.60}")
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r:.60}",
                       param=f"{where}.role")
    extra = set(item) - {"type", "role", "content", "id", "status"}
    if extra:
        raise APIError(400, f"Unrecognized input item field: {where}.{sorted(extra)[0]}",
                       param=f"{where}.{sorted(extra)[0]}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise not_supported(f"{where}.content.{j}", f"content part of type {kind!r:.60}")
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


# Response objects and events ------------------------------------------------------------------------------
def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict[str, Any]:
    part = output_text_part(text, logprobs)
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [part] if status != "in_progress" else []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (the text, not a summary: there is none)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def output_text_part(text: str, logprobs: list | None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def response_object(response_id: str, req: ResponsesRequest, created: int, *, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    finish_reason: str | None = None, error: str | None = None) -> dict[str, Any]:
    """The Response object: `status` "in_progress", "completed", "incomplete" (the output hit
    max_output_tokens) or "failed"."""
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) \
        if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": {"code": "server_error", "message": error} if error is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning_effort, "summary": None},
        "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format}, "tool_choice": req.tool_choice or "auto", "tools": [],
        "top_logprobs": req.top_logprobs, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }


def final_status(finish_reason: str | None, error: str | None) -> str:
    if error is not None:
        return "failed"
    return "incomplete" if finish_reason == "length" else "completed"


def usage_object(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


# The store ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far (without instructions): what a next turn continues
    num_chars: int


class ResponseStore:
    """Responses by id, for retrieve / delete and for `previous_response_id`: bounded by count and by the
    characters of the conversations held, least recently used evicted first. In memory, per API server."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        num_chars = sum(len(m["content"]) for m in messages)
        self.delete(response["id"])
        self._items[response["id"]] = StoredResponse(response, messages, num_chars)
        self.num_chars += num_chars
        while self._items and (len(self._items) > self.max_responses or self.num_chars > self.max_chars):
            _, old = self._items.popitem(last=False)
            self.num_chars -= old.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.num_chars -= item.num_chars
        return True
