"""What every tool-call family shares: the results (`ToolCall`, `ToolParseResult`; for a stream `ToolCallDelta`
and `DeltaMessage`), the `ToolParser` base that builds whole-text parsing and streaming (`ToolCallStream`) on a
family's `_segments`, and the helpers the families' formats have in common (`object_call`, `MarkerToolParser`).

Parsing never raises on model output. Text that does not form a call — a marker followed by something that
is not a call header, JSON without a "name" — stays plain content. A stream emits exactly what the whole-text
parse returns (content, names, argument text), for any split into deltas, with one exception it reports: a
call whose JSON breaks after its arguments began (a stream shows a call, header and argument bytes, once its
arguments begin; the whole-text parse turns the broken call back into content, a stream cannot take back what
it sent, so `ToolCallStream.consistent` turns False). Output cut off
inside a call (max_tokens) is a call with `complete=False` in both modes, as OpenAI reports it.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..parser_registry import held_prefix
from .grammar import TOOL_ARGS_MAX_WHITESPACE
from .json_scan import COMPLETE, INVALID, scan_members

logger = logging.getLogger(__name__)


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
class ParsedCall:
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


PENDING = object()  # "cannot tell yet": the text from the marker on is held back


# Parsers ---------------------------------------------------------------------------------------------------------

class ToolParser:
    """A model family's tool-call format. Subclasses implement `_segments(text, final)`: the whole text so far
    as content strings and `ParsedCall`s, deciding only what later text cannot change (`final`: nothing follows).
    Everything else — whole-text parse, streaming, fallbacks — is built on it here.

    `needs_special_tokens`: the format's markers are special tokens, so the output must be detokenized with
    `skip_special_tokens=False` when tools are in play. `xgrammar_model`: xgrammar's builtin structural tag
    for the format (`structural_tag`). `tool_call_id_length`: the ids the template insists on (Mistral: 9)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    xgrammar_model: ClassVar[str | None] = None
    tool_call_id_length: ClassVar[int | None] = None

    def _segments(self, text: str, final: bool) -> list[str | ParsedCall]:
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
                 for s in segments if isinstance(s, ParsedCall) and s.name is not None]
        return ToolParseResult(content or None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    @property
    def has_structural_tag(self) -> bool:
        """Whether `structural_tag` can constrain this format: xgrammar has a builtin for it, or the family
        writes its own."""
        return self.xgrammar_model is not None or type(self).structural_tag is not ToolParser.structural_tag

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


def object_call(text: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")):
    """A call written as a JSON object {"name": ..., "arguments": {...}} at text[i] ('{'):
    (ParsedCall, end) · (PENDING, _) while its name is unknown · (None, _) when it is not a call."""
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
        return ParsedCall(name, arguments or "{}", True), end
    if name is None:
        return (None, end) if final else (PENDING, end)
    if not final and (args is None or args[0] >= n):  # a stream shows the call once its arguments begin
        return PENDING, end
    return ParsedCall(name, arguments, False), n


class MarkerToolParser(ToolParser):
    """Content, then calls introduced by `start` (the text before it is content). Subclasses parse what
    follows the marker in `_calls_at`. Whitespace next to calls is not content."""

    start: ClassVar[str]

    def _calls_at(self, text: str, j: int, final: bool):
        """The calls after the marker (which ends at j): (list of ParsedCall, end) · (PENDING, _) · (None, _)."""
        raise NotImplementedError

    def _segments(self, text: str, final: bool) -> list[str | ParsedCall]:
        segments: list[str | ParsedCall] = []
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
            if calls is PENDING:
                return segments
            segments.extend(calls)
            if end >= len(text) or not calls[-1].complete:
                return segments
            text_start = search = end
            after_call = True


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
        calls = [s for s in segments if isinstance(s, ParsedCall)]
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
