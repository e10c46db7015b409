"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request schema, how a
request becomes the chat completion the chat path serves, and the two handlers.

A request is served as a chat completion: `system` as a system message, each message's content blocks as chat
messages (`text` as content, an assistant's `tool_use` blocks as its `tool_calls`, a user's `tool_result` blocks
as `role: tool` messages, an assistant's `thinking` as its `reasoning_content`), `tools` as functions,
`tool_choice` auto / any / tool / none as "auto" / "required" / a named function / "none", `stop_sequences` as
`stop`, `thinking` as kiln's thinking budget. So chat templates, tool parsers, reasoning parsers, constrained
decoding and thinking budgets go through the one code path chat completions use. A final assistant message is a
prefill: the answer continues its text. The answer's formatting is in messages_format.py. The API key may come as
`x-api-key` (as Anthropic's clients send it) or as `Authorization: Bearer`.
"""
from __future__ import annotations

import hmac
import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from .async_engine import PromptInput
from .messages_format import MessagesFormatter, as_messages_error
from .protocol import APIError, ChatCompletionRequest, StrictModel, not_supported
from .streaming import SSEResponse, until_disconnect

if TYPE_CHECKING:
    from .serving import OpenAIServer


# Content blocks ----------------------------------------------------------------------------------------------
class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; kiln's prefix cache needs no marks
    citations: list[dict[str, Any]] | None = None


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(StrictModel):
    type: Literal["document"]
    source: dict[str, Any]
    model_config = StrictModel.model_config | {"extra": "allow"}


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock, Field(discriminator="type")]


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


# Requests ----------------------------------------------------------------------------------------------------
class CountTokensRequest(StrictModel):
    """POST /v1/messages/count_tokens: what the prompt is rendered from."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None

    def check_supported(self) -> None:
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
        if self.thinking is not None and self.thinking.type == "enabled" and self.thinking.budget_tokens is None:
            raise APIError(400, "thinking of type 'enabled' needs budget_tokens", param="thinking.budget_tokens")
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
                where = f"messages.{i}.content.{j}"
                if isinstance(block, ImageBlock | DocumentBlock) or isinstance(block, ToolResultBlock) and any(
                        isinstance(b, ImageBlock) for b in block.content if isinstance(block.content, list)):
                    raise not_supported(where, f"{block.type} content (this server serves text models)")
                if isinstance(block, ToolUseBlock | ThinkingBlock) and m.role != "assistant" or \
                        isinstance(block, ToolResultBlock) and m.role != "user":
                    raise APIError(400, f"{where}: a {block.type} block cannot be in a {m.role} message",
                                   param=where)
        prefill = self.prefill()
        if prefill is not None and isinstance(prefill.content, list) and \
                any(isinstance(b, ToolUseBlock) for b in prefill.content):
            raise APIError(400, "the final assistant message (a prefill) cannot hold tool_use blocks",
                           param=f"messages.{len(self.messages) - 1}.content")

    def prefill(self) -> MessageParam | None:
        """The final assistant message, whose text the answer continues."""
        return self.messages[-1] if self.messages[-1].role == "assistant" else None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as chat completions' functions; server tools (web search, bash, ...) are refused."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type", "custom")
            if kind not in ("custom", None):
                raise not_supported(f"tools.{i}.type", f"tools of type {kind!r:.60}")
            extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
            if extra:
                raise APIError(400, f"Unrecognized request argument supplied: tools.{i}.{sorted(extra)[0]}",
                               param=f"tools.{i}.{sorted(extra)[0]}")
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not name:
                raise APIError(400, f"tools.{i}.name: a tool needs a name", param=f"tools.{i}.name")
            if not isinstance(schema, dict):
                raise APIError(400, f"tools.{i}.input_schema: a tool needs a JSON schema object",
                               param=f"tools.{i}.input_schema")
            fn: dict[str, Any] = {"name": name, "parameters": schema}
            if isinstance(tool.get("description"), str):
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool | None]:
        """(tool_choice, parallel_tool_calls) as chat completions take them."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
        if choice.type == "tool":
            return {"type": "function", "function": {"name": choice.name}}, parallel
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` and `messages` as chat messages (role, content, tool_calls, tool_call_id)."""
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "assistant":
                out.append(_assistant_message(m.content))
            else:
                out += _user_messages(m.content)
        last = out[-1]
        if last["role"] == "assistant" and not last["content"].strip() and "tool_calls" not in last:
            out.pop()  # an empty prefill: the answer starts afresh
        return out

    def thinking_fields(self, reasons: bool) -> dict[str, Any]:
        """`thinking` as the chat request's budget: enabled is its budget_tokens, disabled a budget of 0 (on a
        model that thinks; one that does not has nothing to disable), adaptive no budget."""
        t = self.thinking
        if t is None or t.type == "adaptive" or t.type == "disabled" and not reasons:
            return {}
        return {"max_thinking_tokens": t.budget_tokens if t.type == "enabled" else 0}

    def chat_body(self, reasons: bool) -> dict[str, Any]:
        choice, parallel = self.chat_tool_choice()
        return {"model": self.model, "messages": self.chat_messages(), "tools": self.chat_tools(),
                "tool_choice": choice, "parallel_tool_calls": parallel, **self.thinking_fields(reasons)}

    def chat_request(self, reasons: bool) -> ChatCompletionRequest:
        """The chat completion this request is served as (`reasons`: the model has a reasoning parser)."""
        req = ChatCompletionRequest.model_validate(self.chat_body(reasons))
        req.check_supported()
        return req


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `metadata`, `service_tier`, `inference_geo`, `speed` and `cache_control` are accepted
    and have no effect; fields kiln does not serve are refused by name (400)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    cache_control: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's extension, as on chat completions
    seed: int | None = None  # kiln's extension, as on chat completions: reproducible sampling

    def chat_body(self, reasons: bool) -> dict[str, Any]:
        return {**super().chat_body(reasons), "max_tokens": self.max_tokens, "stop": self.stop_sequences,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "stream": self.stream, "cache_salt": self.cache_salt, "seed": self.seed}


def _text_of(content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for b in blocks:
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif isinstance(b, ThinkingBlock):
            thinking.append(b.thinking)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn's blocks in order: each tool_result a `tool` message, each run of text one user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            text = _text_of(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {text}" if b.is_error else text})
        elif isinstance(b, TextBlock):
            texts.append(b.text)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


# Handlers ----------------------------------------------------------------------------------------------------
def check_auth(server: OpenAIServer, request: Request) -> None:
    """`x-api-key` (Anthropic's header) or `Authorization: Bearer` (the OpenAI routes' check)."""
    key = request.headers.get("x-api-key")
    if server.api_key is None or key is None:
        server.check_auth(request)
        return
    if not hmac.compare_digest(key.strip().encode(), server.api_key.encode()):
        raise APIError(401, "invalid x-api-key", code="invalid_api_key")


async def parse(server: OpenAIServer, request: Request, schema: type[CountTokensRequest]) -> Any:
    """OpenAIServer.parse, with Anthropic's API key header."""
    return await server.parse(request, schema, lambda r: check_auth(server, r))


async def render(server: OpenAIServer, chat: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The prompt's text and token ids (a prefill: the text ends where the final assistant message's does)."""
    prefill = chat.messages[-1].role == "assistant"
    text = await server.render_chat(chat.messages, not prefill, None, prefill, tools=chat.tools)
    [ids] = await server.encode([text], add_special_tokens=False, param="messages")
    return text, ids


async def create_message(request: Request) -> Response:
    server: OpenAIServer = request.app.state.server
    try:
        req = await parse(server, request, MessagesRequest)
        chat = req.chat_request(server.reasoning_parser is not None)
        params = server.engine_params(chat)
        server.check_admissible(1, params, chat)
        text, ids = await render(server, chat)
        params, plan = server.plan_chat_request(chat, text, params, await server.grammar(chat.response_format))
        message_id = f"msg_{uuid.uuid4().hex}"
        group = await server.submit([PromptInput(message_id, ids, text)], params, chat)
    except APIError as e:
        raise as_messages_error(e) from None
    fmt = MessagesFormatter(server, chat, message_id, group, plan)
    if req.stream:
        return SSEResponse(fmt.events(), on_close=group.abort)
    return await until_disconnect(request, fmt.collect(), on_close=group.abort)


async def count_tokens(request: Request) -> dict[str, int]:
    server: OpenAIServer = request.app.state.server
    try:
        req = await parse(server, request, CountTokensRequest)
        _, ids = await render(server, req.chat_request(server.reasoning_parser is not None))
    except APIError as e:
        raise as_messages_error(e) from None
    return {"input_tokens": len(ids)}
