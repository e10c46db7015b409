"""Messages for a checkpoint's chat template: messages with `tool_calls` / `role: tool` prepared the way HF's
`apply_chat_template(tools=...)` expects them, and the chat prompt rendered through the template."""
from __future__ import annotations

import hashlib
import json
import string
from typing import TYPE_CHECKING, Any

from ..errors import RequestError

if TYPE_CHECKING:
    from .tool_parsers.base import ToolParser


class JsonArguments(dict):
    """A tool call's arguments as a chat template reads them: a dict (templates iterate `arguments|items` or
    apply `tojson`) that also renders and concatenates as its JSON text (DeepSeek's template writes
    `'\\n' + arguments`)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: str) -> str:
        return str(self) + other

    def __radd__(self, other: str) -> str:
        return other + str(self)


_ID_ALPHABET = string.ascii_letters + string.digits


def _fixed_length_id(value: Any, length: int) -> str:
    """A template's fixed-length id for a client's id: kept when it fits, else derived from it, so an assistant
    message's call and the tool message answering it still match."""
    text = "" if value is None else str(value)
    if len(text) == length and text.isalnum():
        return text
    number = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    out = []
    for _ in range(length):
        number, r = divmod(number, len(_ID_ALPHABET))
        out.append(_ID_ALPHABET[r])
    return "".join(out)


def prepare_messages(messages: list[dict], parser: ToolParser | None = None) -> list[dict]:
    """OpenAI chat messages as HF chat templates expect them: an assistant's `tool_calls[].function.arguments`
    parsed from its JSON string (empty: {}), an empty `tool_calls` dropped, `reasoning` accepted as
    `reasoning_content` (what Qwen3's and GLM's templates read), tool-call ids fitted to the family's fixed
    length where it has one. Raises RequestError on arguments that are not a JSON object."""
    length = parser.tool_call_id_length if parser is not None else None
    out = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{position}] must be an object")
        m = dict(message)
        if m.get("role") == "assistant":
            calls = m.get("tool_calls")
            if calls:
                m["tool_calls"] = [_prepare_call(c, position, k, length) for k, c in enumerate(calls)]
            else:
                m.pop("tool_calls", None)
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop("reasoning")
        elif m.get("role") == "tool" and length is not None and "tool_call_id" in m:
            m["tool_call_id"] = _fixed_length_id(m["tool_call_id"], length)
        out.append(m)
    return out


def _prepare_call(call: Any, position: int, k: int, id_length: int | None) -> dict:
    where = f"messages[{position}].tool_calls[{k}]"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError(f"{where} must be an object with a 'function'")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    fn["arguments"] = JsonArguments(args)
    out = {**call, "function": fn}
    out.setdefault("type", "function")
    if id_length is not None:
        out["id"] = _fixed_length_id(call.get("id"), id_length)
    return out


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, *,
                parser: ToolParser | None = None, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt for a chat request with tools: messages prepared (above) and rendered through the
    checkpoint's chat template with `tools` in HF's convention (a list of {"type": "function", "function":
    {name, description, parameters}}), as `apply_chat_template(messages, tools=tools)` does."""
    return tokenizer.apply_chat_template(prepare_messages(messages, parser), add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, **template_kwargs)
