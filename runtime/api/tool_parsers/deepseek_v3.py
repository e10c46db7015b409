"""DeepSeek-V3 / V3-0324 / R1 / V3.1 tool calls."""
from __future__ import annotations

from typing import ClassVar

from .base import PENDING, MarkerToolParser, ParsedCall
from .json_scan import INVALID, PARTIAL, scan_json, skip_ws


class DeepSeekV3ToolParser(MarkerToolParser):
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
        calls: list[ParsedCall] = []

        def undecided():  # nothing certain after the calls so far
            return (calls, n) if calls else ((None, j) if final else (PENDING, j))

        def stop(at: int):  # what follows is not a call: it is text again
            return (calls, at) if calls else (None, at)

        i = j
        while True:
            i = skip_ws(text, i)
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
                args_at = skip_ws(text, a)
            if not name or any(c in name for c in " <>{}"):
                return stop(begin)
            if args_at >= n:  # the name is known, the arguments have not begun
                if not final:
                    return undecided()
                calls.append(ParsedCall(name, "", False))
                return calls, n
            if text[args_at] != "{":
                return stop(begin)
            status, e = scan_json(text, args_at)
            if status == INVALID:
                return stop(begin)
            if status == PARTIAL:
                calls.append(ParsedCall(name, text[args_at:], False))
                return calls, n
            calls.append(ParsedCall(name, text[args_at:e], True))
            e = skip_ws(text, e)
            if text.startswith("```", e):
                e = skip_ws(text, e + 3)
            if text.startswith(self.call_end, e):
                i = e + len(self.call_end)
            elif not final and (self.call_end.startswith(text[e:]) or "```".startswith(text[e:])):
                return calls, n
            else:
                i = e
