"""Tool calling: a parser per model family (chosen through a registry, or from the chat template's markers)
turns model output into OpenAI `tool_calls`, whole or as streamed deltas; `tool_choice` required / named
(and `auto` with a strict tool) becomes an xgrammar structural tag in the family's native format, so it is
enforced rather than hoped for; and messages with `tool_calls` / `role: tool` are prepared for a checkpoint's
chat template the way HF's `apply_chat_template(tools=...)` expects them.

Parsing never raises on model output. Text that does not form a call — a marker followed by something that
is not a call header, JSON without a "name" — stays plain content. A stream emits exactly what the whole-text
parse returns (content, names, argument text), for any split into deltas, with one exception it reports: a
call whose JSON breaks after its arguments began (a stream shows a call, header and argument bytes, once its
arguments begin; the whole-text parse turns the broken call back into content, a stream cannot take back what
it sent, so `ToolCallStream.consistent` turns False). Output cut off
inside a call (max_tokens) is a call with `complete=False` in both modes, as OpenAI reports it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import RequestError
from ..grammar_spec import GrammarSpec
from .reasoning_parsers import ParserRegistry, held_prefix

logger = logging.getLogger(__name__)

# A JSON prefix scanner -----------------------------------------------------------------------------------------
# Streaming needs to know how much of a call's argument text is certainly JSON (a valid prefix) and where the
# value ends; json.loads only answers for complete text.

COMPLETE, PARTIAL, INVALID = "complete", "partial", "invalid"
_WS = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_STRING_STOP = re.compile(r'["\\]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
MAX_JSON_DEPTH = 64


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _scan_string(s: str, i: int) -> tuple[str, int]:
    """s[i] is '"'. Raw control characters are accepted (json.loads(strict=False) does too)."""
    n = len(s)
    i += 1
    while True:
        m = _STRING_STOP.search(s, i)
        if m is None:
            return PARTIAL, n
        j = m.start()
        if s[j] == '"':
            return COMPLETE, j + 1
        if j + 1 >= n:
            return PARTIAL, n
        e = s[j + 1]
        if e == "u":
            digits = s[j + 2:j + 6]
            if any(c not in _HEX for c in digits):
                return INVALID, j
            if len(digits) < 4:
                return PARTIAL, n
            i = j + 6
        elif e in '"\\/bfnrt':
            i = j + 2
        else:
            return INVALID, j


def scan_json(s: str, i: int = 0) -> tuple[str, int]:
    """Scans one JSON value from s[i] (leading whitespace skipped): (COMPLETE, end of the value), (PARTIAL,
    len(s)) when s[i:] is a valid prefix of one, or (INVALID, index of the first character that cannot
    continue it). A top-level number is never COMPLETE (it could go on); callers scan objects and arrays."""
    n = len(s)
    stack: list[str] = []
    expect = "value"  # value | value_or_close | key | key_or_close | colon | comma_or_close
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return PARTIAL, n
        c = s[i]
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                stack.pop()
                i += 1
            elif c in "{[":
                if len(stack) >= MAX_JSON_DEPTH:
                    return INVALID, i
                stack.append(c)
                i += 1
                expect = "key_or_close" if c == "{" else "value_or_close"
                continue
            elif c == '"':
                status, i = _scan_string(s, i)
                if status != COMPLETE:
                    return status, i
            elif c == "-" or "0" <= c <= "9":
                prefix = _NUMBER_PREFIX.match(s, i)
                if prefix.end() == n:
                    return PARTIAL, n
                m = _NUMBER.match(s, i)
                if m is None or m.end() != prefix.end():
                    return INVALID, m.end() if m else i
                i = m.end()
            elif c in _LITERALS:
                lit = _LITERALS[c]
                if s.startswith(lit, i):
                    i += len(lit)
                elif lit.startswith(s[i:]):
                    return PARTIAL, n
                else:
                    return INVALID, i
            else:
                return INVALID, i
            if not stack:
                return COMPLETE, i
            expect = "comma_or_close"
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                i += 1
                if not stack:
                    return COMPLETE, i
                expect = "comma_or_close"
                continue
            if c != '"':
                return INVALID, i
            status, i = _scan_string(s, i)
            if status != COMPLETE:
                return status, i
            expect = "colon"
        elif expect == "colon":
            if c != ":":
                return INVALID, i
            i += 1
            expect = "value"
        else:
            top = stack[-1]
            if c == ",":
                i += 1
                expect = "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                stack.pop()
                i += 1
                if not stack:
                    return COMPLETE, i
            else:
                return INVALID, i


def scan_members(s: str, i: int) -> tuple[str, int, list[tuple[str, int, int | None]]]:
    """Scans the object at s[i] ('{') member by member: (status, end, [(key, value start, value end or None
    while the value is unfinished)])."""
    n = len(s)
    members: list[tuple[str, int, int | None]] = []
    i += 1
    first = True
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return PARTIAL, n, members
        if s[i] == "}" and first:
            return COMPLETE, i + 1, members
        if s[i] != '"':
            return INVALID, i, members
        status, j = _scan_string(s, i)
        if status != COMPLETE:
            return status, j, members
        key = json.loads(s[i:j], strict=False)
        i = _skip_ws(s, j)
        if i >= n:
            return PARTIAL, n, members
        if s[i] != ":":
            return INVALID, i, members
        i = _skip_ws(s, i + 1)
        if i >= n:
            members.append((key, n, None))
            return PARTIAL, n, members
        status, j = scan_json(s, i)
        members.append((key, i, j if status == COMPLETE else None))
        if status != COMPLETE:
            return status, j, members
        i = _skip_ws(s, j)
        if i >= n:
            return PARTIAL, n, members
        if s[i] == "}":
            return COMPLETE, i + 1, members
        if s[i] != ",":
            return INVALID, i, members
        i += 1
        first = False


# Results ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class ToolCall:
    """`arguments` is the JSON text of the arguments object as the model wrote it (OpenAI sends a string);
    `complete` is False for a call the output ended inside."""

    id: str
    name: str
    arguments: str
    complete: bool = True

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolParseResult:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its first delta carries id, type and name (OpenAI's SDK creates the
    entry from it); later ones only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
        fn: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass(slots=True)
class DeltaMessage:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class _Call:
    """A call found in the text so far. `name` None: its header is not complete yet (a stream holds it).
    `arguments` is kept strict JSON: raw control characters inside strings (xgrammar's JSON grammar lets them
    through; json.loads rejects them) are written as escapes, a per-character rewrite, so a stream's argument
    deltas still concatenate to the whole-text parse's."""

    name: str | None
    arguments: str
    complete: bool

    def __post_init__(self) -> None:
        if _CONTROL.search(self.arguments):
            self.arguments = _escape_controls(self.arguments)


_CONTROL = re.compile(r"[\x00-\x1f]")
_SHORT_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _escape_controls(text: str) -> str:
    out = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            elif ch < " ":
                out.append(_SHORT_ESCAPES.get(ch) or f"\\u{ord(ch):04x}")
                continue
        elif ch == '"':
            in_string = True
        out.append(ch)
    return "".join(out)


_PENDING = object()  # "cannot tell yet": the text from the marker on is held back


# Parsers ---------------------------------------------------------------------------------------------------------

class ToolParser:
    """A model family's tool-call format. Subclasses implement `_segments(text, final)`: the whole text so far
    as content strings and `_Call`s, deciding only what later text cannot change (`final`: nothing follows).
    Everything else — whole-text parse, streaming, fallbacks — is built on it here.

    `needs_special_tokens`: the format's markers are special tokens, so the output must be detokenized with
    `skip_special_tokens=False` when tools are in play. `xgrammar_model`: xgrammar's builtin structural tag
    for the format (`structural_tag`). `tool_call_id_length`: the ids the template insists on (Mistral: 9)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    xgrammar_model: ClassVar[str | None] = None
    tool_call_id_length: ClassVar[int | None] = None

    def _segments(self, text: str, final: bool) -> list[str | _Call]:
        raise NotImplementedError

    def make_id(self) -> str:
        if self.tool_call_id_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.tool_call_id_length))
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> ToolParseResult:
        """The whole output: content (None when empty) and the calls, in order."""
        try:
            segments = self._segments(text, final=True)
        except Exception:  # a parser bug must not fail the request: the text is still the answer
            logger.exception("%s tool parser failed; returning the output as content", self.name)
            return ToolParseResult(text or None, [])
        content = "".join(s for s in segments if isinstance(s, str))
        calls = [ToolCall(self.make_id(), s.name, s.arguments, s.complete)
                 for s in segments if isinstance(s, _Call) and s.name is not None]
        return ToolParseResult(content or None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def structural_tag(self, tools: list[dict], tool_choice: Any = "required", *, parallel_tool_calls: bool = True,
                       reasoning: str = "disabled") -> dict:
        """xgrammar structural tag (JSON form) that makes the model emit calls of `tools` in this format:
        `tool_choice` "required" (at least one call), a named function (exactly that one), or "auto" (free
        text until a call begins, then the call is constrained). `reasoning`: "enabled" (the prompt opened a
        thinking block), "auto" (the model may open one), "disabled"."""
        import xgrammar as xgr

        assert self.xgrammar_model is not None, f"{self.name}: no structural tag"
        tag = xgr.get_model_structural_tag(self.xgrammar_model, tools=tools, tool_choice=tool_choice,
                                           reasoning=reasoning, parallel_tool_calls=parallel_tool_calls,
                                           max_whitespace_cnt=TOOL_ARGS_MAX_WHITESPACE)
        return tag.model_dump(mode="json", by_alias=True)


# Whitespace bound inside constrained tool arguments (see structured_output.GrammarBackend.max_whitespace)
TOOL_ARGS_MAX_WHITESPACE = 8


def _object_call(text: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")):
    """A call written as a JSON object {"name": ..., "arguments": {...}} at text[i] ('{'):
    (_Call, end) · (_PENDING, _) while its name is unknown · (None, _) when it is not a call."""
    status, end, members = scan_members(text, i)
    if status == INVALID:
        return None, end
    n = len(text)
    name: str | None = None
    args: tuple[int, int | None] | None = None
    for key, start, stop in members:
        if key == "name" and stop is not None:
            value = json.loads(text[start:stop])
            if not isinstance(value, str) or not value:
                return None, end
            name = value
        elif key in args_keys and args is None:
            if start < n and text[start] != "{":
                return None, end
            args = (start, stop)
    arguments = "" if args is None else text[args[0]:n if args[1] is None else args[1]]
    if status == COMPLETE:
        if name is None:
            return None, end
        return _Call(name, arguments or "{}", True), end
    if name is None:
        return (None, end) if final else (_PENDING, end)
    if not final and (args is None or args[0] >= n):  # a stream shows the call once its arguments begin
        return _PENDING, end
    return _Call(name, arguments, False), n


class _MarkerToolParser(ToolParser):
    """Content, then calls introduced by `start` (the text before it is content). Subclasses parse what
    follows the marker in `_calls_at`. Whitespace next to calls is not content."""

    start: ClassVar[str]

    def _calls_at(self, text: str, j: int, final: bool):
        """The calls after the marker (which ends at j): (list of _Call, end) · (_PENDING, _) · (None, _)."""
        raise NotImplementedError

    def _segments(self, text: str, final: bool) -> list[str | _Call]:
        segments: list[str | _Call] = []
        text_start = search = 0
        after_call = False
        while True:
            k = text.find(self.start, search)
            if k < 0:
                rest = text[text_start:]
                if final:
                    segments.append(rest.rstrip() if after_call else rest)
                else:  # what may still be a marker or whitespace before one is held back
                    segments.append(rest[:len(rest) - held_prefix(rest, self.start)].rstrip())
                return segments
            calls, end = self._calls_at(text, k + len(self.start), final)
            if calls is None:  # not a call: the marker is text
                search = k + len(self.start)
                continue
            segments.append(text[text_start:k].rstrip())
            if calls is _PENDING:
                return segments
            segments.extend(calls)
            if end >= len(text) or not calls[-1].complete:
                return segments
            text_start = search = end
            after_call = True


def _json_call_then(text: str, i: int, final: bool, end_marker: str):
    """A JSON-object call at text[i], then optional whitespace and `end_marker`."""
    call, end = _object_call(text, i, final)
    if call is None or call is _PENDING:
        return call, end
    if not call.complete:
        return [call], len(text)
    e = _skip_ws(text, end)
    if text.startswith(end_marker, e):
        return [call], e + len(end_marker)
    if not final and end_marker.startswith(text[e:]):
        return [call], len(text)  # the end marker may be on its way
    return [call], end


class HermesToolParser(_MarkerToolParser):
    """Hermes / Qwen2.5 / Qwen3 / QwQ: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one
    block per call; text (or a thinking block, split off before) may precede them."""

    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"
    xgrammar_model = "qwen_3"

    def _calls_at(self, text: str, j: int, final: bool):
        i = _skip_ws(text, j)
        if i >= len(text):
            return (None, i) if final else (_PENDING, i)
        if text[i] != "{":
            return None, i
        return _json_call_then(text, i, final, self.end)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the whole message is `{"name": "f", "parameters": {...}}` (optionally
    after `<|python_tag|>`; "arguments" is accepted too), several joined by `;`. A message that does not
    start with a call is content — including a JSON answer without a "name"."""

    python_tag: ClassVar[str] = "<|python_tag|>"
    xgrammar_model = "llama"

    def _segments(self, text: str, final: bool) -> list[str | _Call]:
        n = len(text)
        i = _skip_ws(text, 0)
        head = text[i:]
        if not final and self.python_tag.startswith(head):
            return []  # nothing yet, or part of the tag: undecided
        if head.startswith(self.python_tag):
            i = _skip_ws(text, i + len(self.python_tag))
        if i >= n or text[i] != "{":
            if i >= n and not final:
                return []
            return [self._content(text, final)]
        calls: list[str | _Call] = []
        while True:
            call, end = _object_call(text, i, final)
            if call is None:
                return calls + [self._content(text[i:], final)] if calls else [self._content(text, final)]
            if call is _PENDING:
                return calls
            calls.append(call)
            if not call.complete:
                return calls
            e = _skip_ws(text, end)
            if e >= n:
                return calls
            if text[e] != ";":
                return calls + [self._content(text[end:], final)]
            i = _skip_ws(text, e + 1)
            if i >= n:
                return calls
            if text[i] != "{":
                return calls + [self._content(text[e:], final)]

    @staticmethod
    def _content(text: str, final: bool) -> str:
        return text if final else text.rstrip()


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(_MarkerToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11, the format of
    Mistral-7B-Instruct-v0.3's template) or `[TOOL_CALLS]f[ARGS]{...}` per call (v11+). Ids must be 9
    alphanumeric characters (its template refuses others)."""

    start: ClassVar[str] = "[TOOL_CALLS]"
    needs_special_tokens = True
    tool_call_id_length = 9

    def _calls_at(self, text: str, j: int, final: bool):
        n = len(text)
        i = _skip_ws(text, j)
        if i >= n:
            return (None, i) if final else (_PENDING, i)
        if text[i] == "[":
            return self._array(text, i + 1, final)
        m = _MISTRAL_NAME.match(text, i)
        if m is None:
            return None, i
        k = m.end()
        if k >= n or (not final and "[ARGS]".startswith(text[k:])):
            return (None, k) if final else (_PENDING, k)  # the name may go on
        if text.startswith("[ARGS]", k):
            k += len("[ARGS]")
        k = _skip_ws(text, k)
        if k >= n:
            return ([_Call(m.group(), "", False)], n) if final else (_PENDING, k)
        if text[k] != "{":
            return None, k
        status, e = scan_json(text, k)
        if status == INVALID:
            return None, e
        if status == PARTIAL:
            return [_Call(m.group(), text[k:], False)], n
        return [_Call(m.group(), text[k:e], True)], e

    def _array(self, text: str, i: int, final: bool):
        n = len(text)
        calls: list[_Call] = []
        while True:
            i = _skip_ws(text, i)
            if i >= n:
                return (calls, n) if calls else ((None, i) if final else (_PENDING, i))
            c = text[i]
            if c == "]":
                return (calls, i + 1) if calls else (None, i)
            if c == "," and calls:
                i += 1
                continue
            if c != "{":
                return (calls, i) if calls else (None, i)
            call, end = _object_call(text, i, final)
            if call is None:
                return (calls, i) if calls else (None, i)
            if call is _PENDING:
                return (calls, n) if calls else (_PENDING, i)
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


class DeepSeekV3ToolParser(_MarkerToolParser):
    """DeepSeek-V3 / V3-0324 / R1: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, closed by `<｜tool▁calls▁end｜>`. The
    V3.1 spelling (`NAME<｜tool▁sep｜>{...}`, no fence) is read too."""

    start: ClassVar[str] = "<｜tool▁calls▁begin｜>"
    calls_end: ClassVar[str] = "<｜tool▁calls▁end｜>"
    call_begin: ClassVar[str] = "<｜tool▁call▁begin｜>"
    call_end: ClassVar[str] = "<｜tool▁call▁end｜>"
    sep: ClassVar[str] = "<｜tool▁sep｜>"
    xgrammar_model = "deepseek_r1"

    def _calls_at(self, text: str, j: int, final: bool):
        n = len(text)
        calls: list[_Call] = []

        def undecided():  # nothing certain after the calls so far
            return (calls, n) if calls else ((None, j) if final else (_PENDING, j))

        def stop(at: int):  # what follows is not a call: it is text again
            return (calls, at) if calls else (None, at)

        i = j
        while True:
            i = _skip_ws(text, i)
            if i >= n:
                return undecided()
            if text.startswith(self.calls_end, i):
                return (calls, i + len(self.calls_end)) if calls else (None, i)
            if not text.startswith(self.call_begin, i):
                rest = text[i:]
                if not final and (self.call_begin.startswith(rest) or self.calls_end.startswith(rest)):
                    return undecided()
                return stop(i)
            begin = i
            i += len(self.call_begin)
            sep = text.find(self.sep, i)
            if sep < 0:
                return undecided() if not final else stop(begin)
            head, k = text[i:sep].strip(), sep + len(self.sep)
            if text.startswith("{", k):  # V3.1: the name before the separator
                name, args_at = head, k
            else:
                nl = text.find("\n", k)
                if nl < 0:
                    return undecided() if not final else stop(begin)
                name, a = text[k:nl].strip(), nl + 1
                if not final and "```json".startswith(text[a:]):  # the fence may be on its way
                    return undecided()
                if text.startswith("```json", a):
                    a += len("```json")
                elif text.startswith("```", a):
                    a += len("```")
                args_at = _skip_ws(text, a)
            if not name or any(c in name for c in " <>{}"):
                return stop(begin)
            if args_at >= n:  # the name is known, the arguments have not begun
                if not final:
                    return undecided()
                calls.append(_Call(name, "", False))
                return calls, n
            if text[args_at] != "{":
                return stop(begin)
            status, e = scan_json(text, args_at)
            if status == INVALID:
                return stop(begin)
            if status == PARTIAL:
                calls.append(_Call(name, text[args_at:], False))
                return calls, n
            calls.append(_Call(name, text[args_at:e], True))
            e = _skip_ws(text, e)
            if text.startswith("```", e):
                e = _skip_ws(text, e + 3)
            if text.startswith(self.call_end, e):
                i = e + len(self.call_end)
            elif not final and (self.call_end.startswith(text[e:]) or "```".startswith(text[e:])):
                return calls, n
            else:
                i = e


class ToolCallStream:
    """Streams one output's tool calls: `feed(delta)` returns the content and call deltas that are certain
    now, `finish()` the rest. Re-splits the text so far on every delta (the family's `_segments`), and sends
    what extends what it sent before."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.consistent = True  # False once the text re-split contradicts something already sent
        self._content_sent = ""
        self._sent: list[list] = []  # per call: [id, name, arguments sent]
        self._failed_at: int | None = None  # a parser exception: the text from here on is streamed as content

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls sent so far (for finish_reason "tool_calls" and usage)."""
        return [ToolCall(i, name, args) for i, name, args in self._sent]

    def feed(self, delta: str) -> DeltaMessage:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> DeltaMessage:
        return self._emit(final=True)

    def _emit(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        if self._failed_at is None:
            try:
                segments = self.parser._segments(self.text, final)
            except Exception:
                logger.exception("%s tool parser failed mid-stream; streaming the rest as content", self.parser.name)
                self.consistent = False
                # best effort: the text after what the content and arguments sent so far account for
                sent = len(self._content_sent) + sum(len(args) for _, _, args in self._sent)
                self._failed_at = min(sent, len(self.text))
        if self._failed_at is not None:
            out.content, self._failed_at = self.text[self._failed_at:], len(self.text)
            return out
        content = "".join(s for s in segments if isinstance(s, str))
        if not content.startswith(self._content_sent):
            self.consistent = False
        if len(content) > len(self._content_sent):
            out.content = content[len(self._content_sent):]
            self._content_sent = content
        calls = [s for s in segments if isinstance(s, _Call)]
        named = 0
        for index, call in enumerate(calls):
            if call.name is None:
                break
            named += 1
            if index >= len(self._sent):
                self._sent.append([self.parser.make_id(), call.name, ""])
                piece = ToolCallDelta(index, self._sent[index][0], call.name)
            else:
                piece = ToolCallDelta(index)
            sent = self._sent[index]
            if sent[1] != call.name or not call.arguments.startswith(sent[2]):
                self.consistent = False
                continue
            piece.arguments, sent[2] = call.arguments[len(sent[2]):], call.arguments
            if piece.id is not None or piece.arguments:
                out.tool_calls.append(piece)
        if named < len(self._sent):
            self.consistent = False
        return out


# Registry ----------------------------------------------------------------------------------------------------

TOOL_PARSERS = ParserRegistry("tool parser")
register_tool_parser = TOOL_PARSERS.register


register_tool_parser("hermes", "qwen", "qwen2_5", "qwen3")(HermesToolParser)
register_tool_parser("llama3_json", "llama")(Llama3JsonToolParser)
register_tool_parser("mistral")(MistralToolParser)
register_tool_parser("deepseek_v3", "deepseek_r1")(DeepSeekV3ToolParser)


def tool_parser_names() -> list[str]:
    return TOOL_PARSERS.names()


def get_tool_parser(name: str) -> ToolParser:
    """`kiln serve --tool-parser NAME`; raises RequestError for an unknown name."""
    return TOOL_PARSERS.get(name)


# A chat template writes the markers its model was trained on; first match wins (Qwen's templates contain no
# other family's markers, Llama's contains "<|python_tag|>").
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("<|python_tag|>", "llama3_json"))


def tool_parser_for(chat_template: str | None) -> str | None:
    """The parser a checkpoint's chat template implies, or None (the model has no tool format kiln knows)."""
    if not chat_template:
        return None
    for marker, name in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return name
    return None


# tool_choice as a grammar --------------------------------------------------------------------------------------

def check_tools(tools: list[dict] | None, tool_choice: Any = "auto") -> None:
    """Validates OpenAI `tools` / `tool_choice` (shapes, a named function that exists, "required" with tools)
    with xgrammar's OpenAI models; raises RequestError (a 400)."""
    from xgrammar import normalize_tool_choice

    try:
        normalize_tool_choice(tools or [], tool_choice)
    except Exception as e:  # ValueError, pydantic.ValidationError
        first = str(e).strip().splitlines()
        raise RequestError(f"invalid tools / tool_choice: {first[0] if first else type(e).__name__}") from None


def tool_choice_grammar(parser: ToolParser, tools: list[dict] | None, tool_choice: Any = "auto", *,
                        parallel_tool_calls: bool = True, reasoning: str = "disabled") -> GrammarSpec | None:
    """What enforces `tool_choice`: "required" and a named function always get the family's structural tag;
    "auto" only when a tool asks for `strict: true` (free text, but a call that begins is constrained);
    "none" and plain "auto" constrain nothing. Raises RequestError on invalid tools."""
    check_tools(tools, tool_choice)
    if not tools or tool_choice == "none":
        return None
    if tool_choice in ("auto", None) and not any(
            isinstance(t, dict) and (t.get("function") or {}).get("strict") is True for t in tools):
        return None
    if parser.xgrammar_model is None and type(parser).structural_tag is ToolParser.structural_tag:
        raise RequestError(f"tool_choice={tool_choice!r} needs a grammar for the {parser.name} format, which kiln "
                           "does not have")
    try:
        tag = parser.structural_tag(tools, "auto" if tool_choice is None else tool_choice,
                                    parallel_tool_calls=parallel_tool_calls, reasoning=reasoning)
    except ValueError as e:
        raise RequestError(f"invalid tools / tool_choice: {e}") from None
    return GrammarSpec.structural_tag(tag)


# Messages for the chat template --------------------------------------------------------------------------------

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
