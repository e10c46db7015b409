"""Hermes / Qwen2.5 / Qwen3 / QwQ tool calls."""
from __future__ import annotations

from typing import ClassVar

from .base import PENDING, MarkerToolParser, object_call
from .json_scan import skip_ws


def _json_call_then(text: str, i: int, final: bool, end_marker: str):
    """A JSON-object call at text[i], then optional whitespace and `end_marker`."""
    call, end = object_call(text, i, final)
    if call is None or call is PENDING:
        return call, end
    if not call.complete:
        return [call], len(text)
    e = skip_ws(text, end)
    if text.startswith(end_marker, e):
        return [call], e + len(end_marker)
    if not final and end_marker.startswith(text[e:]):
        return [call], len(text)  # the end marker may be on its way
    return [call], end


class HermesToolParser(MarkerToolParser):
    """Hermes / Qwen2.5 / Qwen3 / QwQ: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one
    block per call; text (or a thinking block, split off before) may precede them."""

    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"
    xgrammar_model = "qwen_3"

    def _calls_at(self, text: str, j: int, final: bool):
        i = skip_ws(text, j)
        if i >= len(text):
            return (None, i) if final else (PENDING, i)
        if text[i] != "{":
            return None, i
        return _json_call_then(text, i, final, self.end)
