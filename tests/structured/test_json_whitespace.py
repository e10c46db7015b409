"""The JSON whitespace policy (`kiln serve --json-whitespace compact|bounded|any`): json_schema and json_object
grammars are compact by default (no whitespace between tokens, separators "," and ":"), "bounded" allows at most
a couple of characters in a row, "any" the engine's bound as before; the policy is part of the grammar's cache
key, and the flag travels from the command line to the grammar the engine core compiles."""
from __future__ import annotations

import pathlib

import pytest
from kiln.runtime.core.structured_output import GrammarBackend, GrammarSpec, eos_token_ids
from kiln.runtime.grammar_spec import (
    BOUNDED_WHITESPACE,
    GrammarError,
    grammar_spec_from_response_format,
    validate,
)
from kiln.runtime.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")
EMBEDDED = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embedded"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def backend():
    b = GrammarBackend(Tokenizer.from_dir(EMBEDDED), 4096, eos_token_ids([1, 4]))
    yield b
    b.close()


def accepts(backend, spec: GrammarSpec, text: str) -> bool:
    m = xgr.GrammarMatcher(backend.compile(spec))
    return m.accept_string(text) and m.accept_token(backend.stop_token_ids[0])  # whole: the end may follow


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_compact_by_default_rejects_whitespace_between_tokens(backend, kind):
    spec = GrammarSpec.json_schema(SCHEMA) if kind == "json_schema" else GrammarSpec.json_object()
    assert spec.whitespace == "compact"
    assert accepts(backend, spec, '{"a":1}')
    assert accepts(backend, spec, '{"a":1,"b":{"x":[1,{"y":"s t"}],"z":null}}')  # spaces inside strings stay
    for text in ('{ "a": 1}', '{"a": 1}', '{"a":1 }', '{"a":1, "b":{}}', '{"a":1,"b":{"x":[1, 2]}}',
                 '{"a":1,"b":{"x" :1}}', '{"a":1}\n'):
        assert not accepts(backend, spec, text), text


def test_compact_still_needs_the_free_form_comma_fix():
    """xgrammar 0.2.8 writes a free-form value's comma as ", " under separators (",", ":"); kiln rewrites it
    (grammar_spec._ANY_VALUE_COMMA). When this fails, xgrammar honours the separators: drop the rewrite."""
    from xgrammar.testing import _is_grammar_accept_string as raw_accepts

    raw = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
    assert raw_accepts(raw, '{"x":[1, 2]}') and not raw_accepts(raw, '{"x":[1,2]}')


def test_bounded_and_any(backend):
    bounded, anyws = GrammarSpec.json_schema(SCHEMA, whitespace="bounded"), GrammarSpec.json_schema(SCHEMA,
                                                                                                   whitespace="any")
    gap = " " * BOUNDED_WHITESPACE
    for spec in (bounded, anyws):
        assert accepts(backend, spec, '{"a":1}') and accepts(backend, spec, '{ "a": 1, "b": {"x": [1, 2]} }')
        assert accepts(backend, spec, "{" + gap + '"a"' + gap + ":" + gap + "1" + gap + "}")
    assert not accepts(backend, bounded, '{"a":' + " " * (BOUNDED_WHITESPACE + 1) + "1}")
    assert accepts(backend, anyws, '{"a":' + " " * 8 + "1}")  # the engine's bound (grammar_max_whitespace, 8)
    assert not accepts(backend, anyws, '{"a":' + " " * 9 + "1}")


def test_the_policy_is_part_of_the_cache_key(backend):
    specs = [GrammarSpec.json_schema(SCHEMA, whitespace=w) for w in ("compact", "bounded", "any")]
    assert len({s.key for s in specs}) == 3
    compiled = [backend.compile(s) for s in specs]
    assert len({id(c) for c in compiled}) == 3
    assert backend.compile(GrammarSpec.json_schema(SCHEMA, whitespace="any")) is compiled[2]  # a cache hit


def test_response_format_takes_the_servers_policy_and_validate_checks_it():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert grammar_spec_from_response_format(fmt).whitespace == "compact"
    assert grammar_spec_from_response_format(fmt, "any").whitespace == "any"
    assert grammar_spec_from_response_format({"type": "json_object"}, "bounded") == GrammarSpec.json_object("bounded")
    regex = grammar_spec_from_response_format({"type": "regex", "regex": "a+"}, "any")
    assert regex == GrammarSpec.regex("a+")  # not a JSON kind: one cache entry whatever the policy
    for w in ("compact", "bounded", "any"):
        validate(GrammarSpec.json_schema(SCHEMA, whitespace=w))
    with pytest.raises(GrammarError, match="unknown JSON whitespace policy 'loose'"):
        GrammarSpec.json_schema(SCHEMA, whitespace="loose")


def test_the_flag_parses_and_reaches_serve(monkeypatch, embedded_artifact):
    from kiln.runtime import launch
    from kiln.runtime.entrypoint import run

    from kiln.cli import build_parser

    assert build_parser().parse_args(["serve", "art"]).json_whitespace == "compact"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "art", "--json-whitespace", "loose"])
    art = embedded_artifact
    seen = {}
    monkeypatch.setattr(launch, "serve", lambda artifact, **kw: seen.update(kw) or 0)
    for policy in ("bounded", "any"):
        assert run(build_parser().parse_args(["serve", str(art), "--json-whitespace", policy])) == 0
        assert seen["json_whitespace"] == policy
