"""A JSON prefix scanner. Streaming needs to know how much of a call's argument text is certainly JSON (a valid
prefix) and where the value ends; json.loads only answers for complete text."""
from __future__ import annotations

import json
import re

COMPLETE, PARTIAL, INVALID = "complete", "partial", "invalid"
_WS = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_STRING_STOP = re.compile(r'["\\]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
MAX_JSON_DEPTH = 64


def skip_ws(s: str, i: int) -> int:
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
        i = skip_ws(s, i)
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
        i = skip_ws(s, i)
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
        i = skip_ws(s, j)
        if i >= n:
            return PARTIAL, n, members
        if s[i] != ":":
            return INVALID, i, members
        i = skip_ws(s, i + 1)
        if i >= n:
            members.append((key, n, None))
            return PARTIAL, n, members
        status, j = scan_json(s, i)
        members.append((key, i, j if status == COMPLETE else None))
        if status != COMPLETE:
            return status, j, members
        i = skip_ws(s, j)
        if i >= n:
            return PARTIAL, n, members
        if s[i] == "}":
            return COMPLETE, i + 1, members
        if s[i] != ",":
            return INVALID, i, members
        i += 1
        first = False
