"""Anthropic Messages answers: the message object (content blocks `thinking`, `text`, `tool_use`; stop_reason;
usage), its event stream (message_start, ping, then per block content_block_start / content_block_delta... /
content_block_stop, message_delta, message_stop), and errors in Anthropic's shape. The output is split by the
chat path's parsers (ChatFormatter's), so streamed and whole answers agree as chat completions' do."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from ..errors import KilnRuntimeError
from .chat_plan import ChoiceOutput
from .formatters import ChatFormatter
from .protocol import APIError
from .streaming import json_encode

MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "try again later" (kiln's OpenAI routes answer 503)

# chat-request names in errors -> the Messages field they came from
_CHAT_TO_MESSAGES = {"max_completion_tokens": "max_tokens", "max_thinking_tokens": "thinking.budget_tokens",
                     "reasoning_effort": "thinking", "stop": "stop_sequences", "parallel_tool_calls":
                     "tool_choice.disable_parallel_tool_use"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error(e: APIError) -> tuple[int, dict[str, Any]]:
    """The status and body Anthropic answers for `e`: `{"type": "error", "error": {"type", "message"}}`."""
    status = OVERLOADED if e.status == 503 else e.status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


def as_messages_error(e: APIError) -> APIError:
    """An error about the chat request a message is served as, naming the Messages field it came from (the
    message leads with the field, as Anthropic's do)."""
    param = _CHAT_TO_MESSAGES.get(e.param or "", e.param)
    message = e.message
    for chat, messages in _CHAT_TO_MESSAGES.items():
        if chat != "stop":  # a word too common to rename in prose
            message = message.replace(chat, messages)
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a parsed call (the chat template maps it back to the family's id form on the next
    turn, as it does chat completions' ids)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments object; {} for text that is not one (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop: int | str | None, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an output that ended with `finish_reason` / the engine's `stop_reason`."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def content_blocks(out: ChoiceOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.tool_calls:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                       "input": tool_input(fn["arguments"])})
    return blocks


def event(kind: str, **fields: Any) -> bytes:
    """One server-sent event with Anthropic's `event:` line."""
    return b"event: " + kind.encode() + b"\ndata: " + json_encode({"type": kind, **fields}) + b"\n\n"


class MessagesFormatter(ChatFormatter):
    """One choice's output as a Messages answer: whole (`collect`) or as its event stream (`events`). The
    thinking, text and tool_use blocks come in the order the model wrote them; streamed, a block opens when its
    first piece arrives and closes when another kind begins or the output ends."""

    def message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.server.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": self.message_usage()}

    def message_usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens}
        if self.reasoning_tokens is not None:
            usage["output_tokens_details"] = {"thinking_tokens": self.reasoning_tokens}
        return usage

    async def collect(self) -> Response:
        text, token_ids, finish, stop = [], [], None, None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    text.append(c.text)
                    token_ids += c.token_ids
                    if c.finish_reason is not None:
                        finish, stop = c.finish_reason, c.stop_reason
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        self.completion_tokens = len(token_ids)
        self.count_reasoning(token_ids)
        out = self.parsers[0].parse("".join(text))
        reason, sequence = stop_reason(finish, stop, bool(out.tool_calls))
        return JSONResponse(self.message(content_blocks(out), reason, sequence))

    async def events(self) -> AsyncIterator[bytes]:
        yield event("message_start", message=self.message([], None, None))
        yield event("ping")
        blocks = _BlockStream()
        parser, token_ids, finish, stop = self.parsers[0], [], None, None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    token_ids += c.token_ids
                    self.completion_tokens += len(c.token_ids)
                    if c.finish_reason is not None:
                        finish, stop = c.finish_reason, c.stop_reason
                    for e in blocks.feed(parser.feed(c.text, c.finish_reason is not None)):
                        yield e
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield event("error", error={"type": "api_error", "message": str(e)})
            return
        for e in blocks.close():
            yield e
        self.count_reasoning(token_ids)
        reason, sequence = stop_reason(finish, stop, parser.has_tool_calls)
        usage = self.message_usage()
        usage.pop("input_tokens")
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
        yield event("message_stop")


class _BlockStream:
    """The content blocks of a stream: which one is open (its index and kind), and the events that open, extend
    and close them as the parser's pieces (reasoning, content, tool-call deltas) arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.call: int | None = None  # the open tool_use block's call index

    def open(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return [*events, event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind, self.call = None, None
        return [event("content_block_stop", index=self.index)]

    def delta(self, body: dict[str, Any]) -> bytes:
        return event("content_block_delta", index=self.index, delta=body)

    def feed(self, out: ChoiceOutput) -> list[bytes]:
        events: list[bytes] = []
        if out.reasoning:
            if self.kind != "thinking":
                events += self.open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta({"type": "thinking_delta", "thinking": out.reasoning}))
        if out.content:
            if self.kind != "text":
                events += self.open({"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": out.content}))
        for d in out.tool_calls:
            if d.get("id") is not None or self.call != d["index"]:
                events += self.open({"type": "tool_use", "id": tool_use_id(d.get("id") or ""),
                                     "name": d["function"].get("name", ""), "input": {}})
                self.call = d["index"]
            if d["function"].get("arguments"):
                events.append(self.delta({"type": "input_json_delta", "partial_json": d["function"]["arguments"]}))
        return events
