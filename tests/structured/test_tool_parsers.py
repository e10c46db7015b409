"""Tool-call parsers: the JSON prefix scanner against json.loads; each family's format, whole and streamed in
random pieces (the deltas equal the whole-text parse, cut-off outputs included); malformed output falls back
to content and nothing raises; the deltas build the right message in the OpenAI SDK's own stream state."""
from __future__ import annotations

import json
import random

import pytest
from kiln.runtime.api.tool_parsers import (
    COMPLETE,
    INVALID,
    PARTIAL,
    get_tool_parser,
    scan_json,
    tool_parser_names,
)

# Scanner ------------------------------------------------------------------------------------------------------

DOCS = [
    '{}', '[]', '{"a": 1}', '{"a": [1, 2.5, -3e-2, 0, true, false, null], "b": {"c": "d"}}',
    '{"s": "quote \\" backslash \\\\ unicode \\u00e9 \\n tab \\t"}', '[{"x": []}, {"y": {}}, "z", 10E+3]',
    '{ "spaced" :\n\t[ 1 ,\n 2 ] }', '{"ü": "日本語", "emoji": "😀"}', '{"n": -0.0, "m": 123456789012345678901}',
]
BAD = ['{"a": 1,}', "{'a': 1}", '{"a" 1}', '[1 2]', '{"a": tru e}', '{"a": 01}', '{"a": "\\q"}', '{"a": NaN}',
       '{"a": 1]', '[1, 2}', '{"a": "\\u12G4"}', '{,}', '{"a": .5}', '{"a": 1.}', '{"a": -}']


@pytest.mark.parametrize("doc", DOCS)
def test_scanner_complete_and_every_prefix_partial(doc):
    assert scan_json(doc) == (COMPLETE, len(doc))
    assert scan_json(doc + ' trailing "text"') == (COMPLETE, len(doc))
    for k in range(1, len(doc)):
        assert scan_json(doc[:k]) == (PARTIAL, k), doc[:k]


@pytest.mark.parametrize("doc", BAD)
def test_scanner_rejects_invalid_json(doc):
    status, at = scan_json(doc)
    assert status == INVALID
    for k in range(1, at + 1):  # everything before the bad character is still a valid prefix
        assert scan_json(doc[:k])[0] == PARTIAL


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -1, 7, 3.25, -1e-9, 12345678])
    if kind in (2, 3):
        return "".join(rng.choice('ab "\\\n\té😀') for _ in range(rng.randrange(5)))
    if kind in (4, 5):
        return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_scanner_agrees_with_json_loads_on_random_and_mutated_documents():
    rng = random.Random(0)
    for _ in range(1500):
        value = {"root": _random_json(rng)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]))
        assert scan_json(text) == (COMPLETE, len(text))
        # one random edit: the scanner calls it a complete document exactly when json.loads parses it
        i = rng.randrange(len(text))
        edited = rng.choice([text[:i] + text[i + 1:], text[:i] + rng.choice('{}[]",:1 ae\\') + text[i:]])
        status, end = scan_json(edited)
        try:
            loaded = json.loads(edited, strict=False)
            ok = isinstance(loaded, (dict, list))
        except json.JSONDecodeError:
            ok = False
        assert (status == COMPLETE and not edited[end:].strip()) == ok, edited


# Families -------------------------------------------------------------------------------------------------------

# (parser, model output, expected content, expected [(name, arguments as a Python value)])
CASES = [
    ("hermes", "The weather is nice.", "The weather is nice.", []),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>', None, [("a", {"x": [1, {"y": None}]}), ("b", {})]),
    ("hermes", '<tool_call>{"arguments": {"q": "kiln"}, "name": "search"}</tool_call>', None,
     [("search", {"q": "kiln"})]),
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "a\\"b</tool_call>"}}', None,
     [("f", {"s": 'a"b</tool_call>'})]),  # no end marker (EOS right after the object); a marker inside a string
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "\nDone.", [("f", {})]),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}'
     '</tool_call>', []),
    ("hermes", 'a <tool_call>\n{"name": "f", "arguments": "x"}', 'a <tool_call>\n{"name": "f", "arguments": "x"}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '  {"answer": 42}', '  {"answer": 42}', []),
    ("llama3_json", "The answer is 42.", "The answer is 42.", []),
    ("llama3_json", '{"name": "f", "parameters": {}} and then some words', " and then some words", [("f", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}, "id": "abcdefghi"}]',
     None, [("f", {"a": 1}), ("g", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g{"b": [2]}', "Sure.", [("f", {"a": 1}), ("g", {"b": [2]})]),
    ("mistral", "[TOOL_CALLS] hello world", "[TOOL_CALLS] hello world", []),
    ("mistral", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("deepseek_v3", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
     '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
     '{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     None, [("f", {"a": 1})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>oops", "<｜tool▁calls▁begin｜>oops", []),
]


def _streamed(parser, text: str, rng: random.Random):
    """Feeds `text` in random pieces (single characters included); returns (content, [(name, args)], stream)."""
    stream = parser.stream()
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12)))) if len(text) > 1 else []
    deltas = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [stream.finish()]
    content, names, args = "", {}, {}
    for d in deltas:
        content += d.content
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index == len(names), "indices must be contiguous from 0, first delta creates the call"
                names[piece.index] = piece.name
                args[piece.index] = ""
            args[piece.index] += piece.arguments
    return content, [(names[i], args[i]) for i in sorted(names)], stream


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}:{c[1][:24]}")
def test_family_formats(case):
    name, text, content, calls = case
    result = get_tool_parser(name).parse(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert all(c.complete for c in result.tool_calls)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}:{c[1][:24]}")
def test_streaming_equals_whole_text_parse_for_every_cut(case):
    """Every prefix of the output (an output cut off there by max_tokens) streamed in random pieces gives what
    the whole-text parse of that prefix gives."""
    name, text, _, _ = case
    parser = get_tool_parser(name)
    rng = random.Random(text)
    for end in range(1, len(text) + 1):
        prefix = text[:end]
        full = parser.parse(prefix)
        content, calls, stream = _streamed(parser, prefix, rng)
        assert stream.consistent, prefix
        assert content == (full.content or ""), prefix
        assert calls == [(c.name, c.arguments) for c in full.tool_calls], prefix


def test_cut_off_call_is_an_incomplete_call_in_both_modes():
    parser = get_tool_parser("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    result = parser.parse(text)
    assert [(c.name, c.arguments, c.complete) for c in result.tool_calls] == [
        ("get_weather", '{"city": "Pa', False)]
    assert _streamed(parser, text, random.Random(1))[1] == [("get_weather", '{"city": "Pa')]


def test_arguments_that_break_after_streaming_began_are_reported():
    """The one case a stream cannot match: it sent the call's header and argument bytes, then the JSON broke.
    The whole-text parse returns the text as content; the stream says it is inconsistent."""
    parser = get_tool_parser("hermes")
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
    assert parser.parse(text).tool_calls == [] and parser.parse(text).content == text
    stream = parser.stream()
    cut = text.index("1,") + 2
    sent = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
    assert sent[0].tool_calls and sent[0].tool_calls[0].name == "f"
    assert not stream.consistent


def test_raw_control_characters_in_arguments_become_escapes():
    """xgrammar's JSON grammar lets raw control characters into strings; clients json.loads strictly."""
    parser = get_tool_parser("hermes")
    text = '<tool_call>{"name": "f", "arguments": {"s": "a\x0cb\nc"}}</tool_call>'
    (call,) = parser.parse(text).tool_calls
    assert json.loads(call.arguments) == {"s": "a\x0cb\nc"}
    assert _streamed(parser, text, random.Random(2))[1] == [("f", call.arguments)]


def test_mistral_ids_are_nine_alphanumerics():
    parser = get_tool_parser("mistral")
    (call,) = parser.parse('[TOOL_CALLS] [{"name": "f", "arguments": {}}]').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    assert get_tool_parser("hermes").parse('<tool_call>{"name": "f"}</tool_call>').tool_calls[0].id.startswith("call_")


_FRAGMENTS = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', '<｜tool▁calls▁begin｜>',
              '<｜tool▁call▁begin｜>', '<｜tool▁sep｜>', '<｜tool▁call▁end｜>', '<｜tool▁calls▁end｜>', '{', '}', '[',
              ']', '"', '\\', ':', ',', ';', '"name"', '"arguments"', '"parameters"', '"f"', '1', 'true', ' ', '\n',
              '```json\n', 'function', 'word', '\x00']


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "deepseek_v3"])
def test_garbage_never_raises(name):
    parser = get_tool_parser(name)
    rng = random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randrange(1, 30)))
        result = parser.parse(text)
        for call in result.tool_calls:
            if call.complete:
                assert isinstance(json.loads(call.arguments), dict)
        content, calls, stream = _streamed(parser, text, rng)
        if stream.consistent:
            assert content == (result.content or "")
            assert calls == [(c.name, c.arguments) for c in result.tool_calls]


def test_registry_knows_the_families():
    assert {"hermes", "llama3_json", "mistral", "deepseek_v3"} <= set(tool_parser_names())
    from kiln.runtime.errors import RequestError

    with pytest.raises(RequestError, match="unknown tool parser"):
        get_tool_parser("nope")


def test_families_are_imported_when_first_asked_for():
    """Importing the package imports no family's module; asking for one by any of its names imports that one
    alone, and its class is named by its first name (the registry's convention)."""
    code = """
import sys
import kiln.runtime.api.tool_parsers as tp
def families():
    return sorted(m.rsplit(".", 1)[1] for m in sys.modules
                  if m.startswith("kiln.runtime.api.tool_parsers.") and m.rsplit(".", 1)[1] not in
                  ("base", "grammar", "json_scan"))
print(families())
print(tp.get_tool_parser("qwen3").name, type(tp.get_tool_parser("qwen3")).__name__)
print(families())
print(tp.get_tool_parser("deepseek_r1").name, tp.get_tool_parser("llama").name, tp.get_tool_parser("mistral").name)
print(families())
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "hermes HermesToolParser", "['hermes']", "deepseek_v3 llama3_json mistral",
                   "['deepseek_v3', 'hermes', 'llama3_json', 'mistral']"]


def test_openai_sdk_assembles_the_streamed_calls():
    """The deltas, put into chat.completion.chunk objects, build the expected message in the SDK's own
    ChatCompletionStreamState (it indexes tool_calls[index] and needs the first delta to create the entry)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    parser = get_tool_parser("hermes")
    text = ('Looking.\n<tool_call>\n{"name": "a", "arguments": {"x": "1 2 3"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "b", "arguments": {"y": [true]}}\n</tool_call>')
    stream, state = parser.stream(), ChatCompletionStreamState()
    deltas = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)] + [stream.finish()]

    def chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    state.handle_chunk(chunk({"role": "assistant", "content": ""}))
    for d in deltas:
        delta: dict = {}
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [t.to_openai() for t in d.tool_calls]
        if delta:
            state.handle_chunk(chunk(delta))
    state.handle_chunk(chunk({}, "tool_calls"))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Looking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("a", {"x": "1 2 3"}), ("b", {"y": [True]})]
    assert len({c.id for c in message.tool_calls}) == 2
