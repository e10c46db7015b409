"""Mistral tool calls (`[TOOL_CALLS]`), and their grammar: xgrammar has no builtin for them."""
from __future__ import annotations

import re
from typing import Any, ClassVar

from .base import PENDING, MarkerToolParser, ParsedCall, object_call
from .grammar import TOOL_ARGS_MAX_WHITESPACE
from .json_scan import INVALID, PARTIAL, scan_json, skip_ws

_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(MarkerToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11, the format of
    Mistral-7B-Instruct-v0.3's template) or `[TOOL_CALLS]f[ARGS]{...}` per call (v11+). Ids must be 9
    alphanumeric characters (its template refuses others)."""

    start: ClassVar[str] = "[TOOL_CALLS]"
    needs_special_tokens = True
    tool_call_id_length = 9

    def _calls_at(self, text: str, j: int, final: bool):
        n = len(text)
        i = skip_ws(text, j)
        if i >= n:
            return (None, i) if final else (PENDING, i)
        if text[i] == "[":
            return self._array(text, i + 1, final)
        m = _MISTRAL_NAME.match(text, i)
        if m is None:
            return None, i
        k = m.end()
        if k >= n or (not final and "[ARGS]".startswith(text[k:])):
            return (None, k) if final else (PENDING, k)  # the name may go on
        if text.startswith("[ARGS]", k):
            k += len("[ARGS]")
        k = skip_ws(text, k)
        if k >= n:
            return ([ParsedCall(m.group(), "", False)], n) if final else (PENDING, k)
        if text[k] != "{":
            return None, k
        status, e = scan_json(text, k)
        if status == INVALID:
            return None, e
        if status == PARTIAL:
            return [ParsedCall(m.group(), text[k:], False)], n
        return [ParsedCall(m.group(), text[k:e], True)], e

    def _array(self, text: str, i: int, final: bool):
        n = len(text)
        calls: list[ParsedCall] = []
        while True:
            i = skip_ws(text, i)
            if i >= n:
                return (calls, n) if calls else ((None, i) if final else (PENDING, i))
            c = text[i]
            if c == "]":
                return (calls, i + 1) if calls else (None, i)
            if c == "," and calls:
                i += 1
                continue
            if c != "{":
                return (calls, i) if calls else (None, i)
            call, end = object_call(text, i, final)
            if call is None:
                return (calls, i) if calls else (None, i)
            if call is PENDING:
                return (calls, n) if calls else (PENDING, i)
            calls.append(call)
            if not call.complete:
                return calls, n
            i = end

    def structural_tag(self, tools: list[dict], tool_choice: Any = "required", *, parallel_tool_calls: bool = True,
                       reasoning: str = "disabled") -> dict:
        """xgrammar has no builtin for Mistral: `[TOOL_CALLS]` then a JSON array of {name, arguments}, each
        item one of the allowed tools with its parameters schema."""
        from xgrammar import normalize_tool_choice
        from xgrammar.structural_tag import (
            AnyTextFormat,
            JSONSchemaFormat,
            StructuralTag,
            TagFormat,
            TriggeredTagsFormat,
        )

        functions, _, choice = normalize_tool_choice(tools, tool_choice)
        items = []
        for tool in functions:
            fn = tool.function
            params = True if fn.strict is False or fn.parameters is None else fn.parameters
            # the template writes each past call's 9-character id after its arguments: the model may too
            items.append({"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params,
                                                           "id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}},
                          "required": ["name", "arguments"], "additionalProperties": False})
        if not items:  # "auto" with no tools left: plain text
            return StructuralTag(format=AnyTextFormat()).model_dump(mode="json", by_alias=True)
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel_tool_calls or choice == "forced":
            schema["maxItems"] = 1
        calls = TagFormat(begin=self.start + " ", content=JSONSchemaFormat(
            json_schema=schema, max_whitespace_cnt=TOOL_ARGS_MAX_WHITESPACE), end="")
        fmt = calls if choice != "auto" else TriggeredTagsFormat(triggers=[self.start], tags=[calls],
                                                                 stop_after_first=True)
        return StructuralTag(format=fmt).model_dump(mode="json", by_alias=True)
