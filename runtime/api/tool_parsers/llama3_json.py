"""Llama 3.1 / 3.2 JSON tool calls."""
from __future__ import annotations

from typing import ClassVar

from .base import PENDING, ParsedCall, ToolParser, object_call
from .json_scan import skip_ws


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the whole message is `{"name": "f", "parameters": {...}}` (optionally
    after `<|python_tag|>`; "arguments" is accepted too), several joined by `;`. A message that does not
    start with a call is content — including a JSON answer without a "name"."""

    python_tag: ClassVar[str] = "<|python_tag|>"
    xgrammar_model = "llama"

    def _segments(self, text: str, final: bool) -> list[str | ParsedCall]:
        n = len(text)
        i = skip_ws(text, 0)
        head = text[i:]
        if not final and self.python_tag.startswith(head):
            return []  # nothing yet, or part of the tag: undecided
        if head.startswith(self.python_tag):
            i = skip_ws(text, i + len(self.python_tag))
        if i >= n or text[i] != "{":
            if i >= n and not final:
                return []
            return [self._content(text, final)]
        calls: list[str | ParsedCall] = []
        while True:
            call, end = object_call(text, i, final)
            if call is None:
                return calls + [self._content(text[i:], final)] if calls else [self._content(text, final)]
            if call is PENDING:
                return calls
            calls.append(call)
            if not call.complete:
                return calls
            e = skip_ws(text, end)
            if e >= n:
                return calls
            if text[e] != ";":
                return calls + [self._content(text[end:], final)]
            i = skip_ws(text, e + 1)
            if i >= n:
                return calls
            if text[i] != "{":
                return calls + [self._content(text[e:], final)]

    @staticmethod
    def _content(text: str, final: bool) -> str:
        return text if final else text.rstrip()
