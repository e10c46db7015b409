"""Tool calls without a family format, as vLLM serves them: `tool_choice` "required" or a named function is
constrained to the calls' JSON itself, whatever the chat template — "required" to an array of
`{"name": <one of the tools>, "arguments": <that tool's parameters>}` (at least one; exactly one when
`parallel_tool_calls` is false), a named function to its arguments object — and `JsonToolParser` reads the
calls back from that output, whole or streamed. `auto` cannot be served this way (nothing tells a call from an
answer), so it still needs a family parser. Registered as the "json" tool parser, imported on first use."""
from __future__ import annotations

from typing import Any, ClassVar

from ...errors import RequestError
from ...grammar_spec import GrammarSpec
from .base import PENDING, ParsedCall, ToolParser, object_call
from .json_scan import COMPLETE, PARTIAL, scan_json, skip_ws

_DEF_KEYS = ("$defs", "definitions")  # where a parameters schema's "$ref"s point ("#/$defs/X")


class JsonToolParser(ToolParser):
    """The output is the calls' JSON (`for_choice` builds the grammar that makes it so): with `function` None
    an array of {"name", "arguments"} objects, else `function`'s arguments object alone. Text that is not of
    that shape (an unconstrained output) is content."""

    constrained_only: ClassVar[bool] = True  # only with a grammar: tool_choice "required" or a named function

    def __init__(self, function: str | None = None) -> None:
        self.function = function

    @classmethod
    def for_choice(cls, tools: list[dict], tool_choice: Any, *, parallel_tool_calls: bool = True,
                   whitespace: str = "compact") -> tuple[GrammarSpec, JsonToolParser]:
        """The grammar of `tool_choice` ("required" or {"type": "function", "function": {"name": ...}}, already
        checked against `tools`) and the parser of its output. Raises RequestError for tools whose parameter
        schemas define one `$defs` name differently (they share the grammar's root)."""
        functions = {f["name"]: f for f in (t.get("function") or {} for t in tools if isinstance(t, dict))
                     if isinstance(f, dict) and isinstance(f.get("name"), str)}
        defs: dict[str, dict] = {}
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            schema = _parameters(functions[name], defs)
            parser = cls(name)
        else:
            items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _parameters(f, defs)},
                      "required": ["name", "arguments"], "additionalProperties": False} for n, f in functions.items()]
            schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
            if not parallel_tool_calls:
                schema["maxItems"] = 1
            parser = cls()
        for key in _DEF_KEYS:
            if defs.get(key):
                schema = {**schema, key: defs[key]}
        return GrammarSpec.json_schema(schema, strict=True, whitespace=whitespace), parser

    def _segments(self, text: str, final: bool) -> list[str | ParsedCall]:
        return self._named(text, final) if self.function is not None else self._array(text, final)

    def _named(self, text: str, final: bool) -> list[str | ParsedCall]:
        i = skip_ws(text, 0)
        if i >= len(text):
            return []
        if text[i] != "{":
            return [_content(text, final)]
        status, end = scan_json(text, i)
        if status == COMPLETE:
            return [ParsedCall(self.function, text[i:end], True), *_rest(text, end)]
        if status == PARTIAL:
            return [ParsedCall(self.function, text[i:], False)]
        return [_content(text, final)]

    def _array(self, text: str, final: bool) -> list[str | ParsedCall]:
        n = len(text)
        i = skip_ws(text, 0)
        if i >= n:
            return []
        if text[i] != "[":
            return [_content(text, final)]
        calls: list[str | ParsedCall] = []
        i = skip_ws(text, i + 1)
        while i < n:
            if text[i] != "{":
                return calls + [_content(text[i:] if calls else text, final)]
            call, end = object_call(text, i, final, args_keys=("arguments",))
            if call is None:
                return calls + [_content(text[i:] if calls else text, final)]
            if call is PENDING:
                return calls
            calls.append(call)
            if not call.complete:
                return calls
            e = skip_ws(text, end)
            if e >= n:
                return calls
            if text[e] == "]":
                return calls + _rest(text, e + 1)
            if text[e] != ",":
                return calls + [_content(text[e:], final)]
            i = skip_ws(text, e + 1)
        return calls


def _parameters(function: dict, defs: dict[str, dict]) -> dict:
    """`function`'s parameters schema (an empty object without one) with its `$defs` moved into `defs`."""
    schema = function.get("parameters")
    if not isinstance(schema, dict):
        return {"type": "object", "properties": {}}
    schema = dict(schema)
    for key in _DEF_KEYS:
        own = schema.pop(key, None)
        if not isinstance(own, dict):
            continue
        shared = defs.setdefault(key, {})
        for name, value in own.items():
            if name in shared and shared[name] != value:
                raise RequestError(f"invalid tools: two functions' parameters define {key}/{name} differently; "
                                   "rename one")
            shared[name] = value
    return schema


def _content(text: str, final: bool) -> str:
    return text if final else text.rstrip()


def _rest(text: str, end: int) -> list[str]:
    rest = text[end:].strip()
    return [rest] if rest else []

