"""The grammar backend and the batch processor on the embedded model's tokenizer: request shapes, xgrammar's
errors as 400s, the compile cache (LRU, failures, in-flight sharing, timeout), per-sequence accept / rollback
/ draft validation against fresh matchers, and the batch mask: constrained rows get exactly their grammar's
tokens, unconstrained rows are untouched, padded vocabulary ids are masked, thinking gates and budgets."""
from __future__ import annotations

import json
import pathlib
import re
import threading
import time

import pytest
import torch
from kiln.runtime.core.sequence import PLACEHOLDER_TOKEN, Sequence
from kiln.runtime.core.structured_output import (
    GrammarBackend,
    GrammarError,
    GrammarSpec,
    StructuredOutputProcessor,
    eos_token_ids,
)
from kiln.runtime.grammar_spec import grammar_spec_from_response_format, validate
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.thinking import ThinkingConfig, ThinkPhase
from kiln.runtime.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")
EMBEDDED = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embedded"
V = 4096
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"]}
BOUNDED = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "b": {"type": "string", "maxLength": 5},
                                            "c": {"enum": ["x", "y"]}}, "required": ["a", "b", "c"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(EMBEDDED)


@pytest.fixture(scope="module")
def backend(tok):
    b = GrammarBackend(tok, V, eos_token_ids([1, 4], tok))
    yield b
    b.close()


def allowed(bitmask_row: torch.Tensor, vocab: int = V) -> set[int]:
    bits = ((bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def fresh_allowed(backend, compiled, prefix: list[int]) -> set[int]:
    m = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert m.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    m.fill_next_token_bitmask(mask, 0)
    return allowed(mask[0], backend.vocab_size)


def seq(request_id: str, output: list[int], index: int = 0, prompt: tuple[int, ...] = (0, 3, 9)) -> Sequence:
    ids = list(prompt) + list(output)
    return Sequence(seq_id=hash((request_id, index)) & 0xFFFF, request_id=request_id, index=index, token_ids=ids,
                    num_prompt_tokens=len(prompt), params=SamplingParams(), max_tokens=64, arrival=0)


# Requests --------------------------------------------------------------------------------------------------------

def test_response_format_shapes():
    assert grammar_spec_from_response_format(None) is None
    assert grammar_spec_from_response_format({"type": "text"}) is None
    assert grammar_spec_from_response_format({"type": "json_object"}).kind == "json_object"
    spec = grammar_spec_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "Person_1", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json_schema" and spec.strict and json.loads(spec.spec) == SCHEMA
    assert list(json.loads(spec.spec)["properties"]) == ["a", "b"]  # property order is meaning: kept
    assert grammar_spec_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x"}}).kind == "json_object"
    assert grammar_spec_from_response_format({"type": "regex", "regex": "[ab]+"}).spec == "[ab]+"
    assert json.loads(grammar_spec_from_response_format({"type": "choice", "choice": ["yes", "no"]}).spec) == ["yes", "no"]
    for bad, why in [({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
                     ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}, "name"),
                     ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}, "not valid JSON"),
                     ({"type": "choice", "choice": []}, "non-empty"), ({"type": "regex"}, "needs a 'regex'"),
                     ({"type": "yaml"}, "unknown response_format type"), ("json", "must be an object")]:
        with pytest.raises(GrammarError, match=why):
            grammar_spec_from_response_format(bad)


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec.json_schema({"type": "strin"}), 'invalid json_schema: Unsupported type "strin"'),
    (GrammarSpec.regex("a(b"), "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    (GrammarSpec.grammar('root ::= "a" | '), "invalid grammar: EBNF parser error at line 1"),
])
def test_xgrammars_message_is_the_400(backend, spec, message):
    for check in (validate, backend.compile):  # the API server's cheap check and the engine's compile agree
        with pytest.raises(GrammarError) as e:
            check(spec)
        assert str(e.value).startswith(message)
        assert not re.search(r"\.cc:\d+", str(e.value))  # xgrammar's source location is dropped


def test_valid_specs_validate():
    for spec in (GrammarSpec.json_object(), GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(r"\d{3}"),
                 GrammarSpec.choice(['say "hi"', "ünï\ncode"]), GrammarSpec.grammar('root ::= "a" root | "b"'),
                 GrammarSpec.grammar('start: "x" | "y"')):
        validate(spec)


def test_eos_union(tok):
    assert eos_token_ids([4], tok) == [1, 4]  # config.json's <|im_end|>, tokenizer_config's </s>


# Compile cache --------------------------------------------------------------------------------------------------

def test_cache_hits_evicts_and_remembers_failures(tok, monkeypatch):
    b = GrammarBackend(tok, V, [1, 4], cache_size=2)
    try:
        calls = []
        real = b._compile_now
        monkeypatch.setattr(b, "_compile_now", lambda spec: (calls.append(spec.kind), real(spec))[1])
        first = b.compile(GrammarSpec.regex("a+"))
        assert b.compile(GrammarSpec.regex("a+")) is first and len(calls) == 1
        b.compile(GrammarSpec.regex("b+"))
        b.compile(GrammarSpec.regex("c+"))  # evicts a+ (least recently used)
        assert b.compile(GrammarSpec.regex("a+")) is not first and len(calls) == 4
        bad = GrammarSpec.regex("(")
        for _ in range(2):
            with pytest.raises(GrammarError):
                b.compile(bad)
        assert calls.count("regex") == 5  # the failure was compiled once, then answered from the cache
    finally:
        b.close()


def test_concurrent_requests_share_one_compile_and_a_slow_one_times_out(tok, monkeypatch):
    b = GrammarBackend(tok, V, [1, 4], compile_timeout=0.05)
    try:
        release = threading.Event()
        real = b._compile_now
        monkeypatch.setattr(b, "_compile_now", lambda spec: (release.wait(5), real(spec))[1])
        spec = GrammarSpec.json_schema(SCHEMA)
        f1, f2 = b.compile_async(spec), b.compile_async(spec)
        assert f1 is f2
        start = time.monotonic()
        with pytest.raises(GrammarError, match="took longer than 0.05 s"):
            b.result(f1)
        assert time.monotonic() - start < 2
        release.set()
        compiled = b.result(f1, timeout=5)
        assert b.compile(spec) is compiled  # finished in the background and cached
    finally:
        b.close()


def test_slow_grammars_give_their_compile_slots_back_after_the_timeout(tok, monkeypatch):
    """Issue 29 item 10: two slow grammars (one client's huge schemas) held both compile workers, and a quick
    grammar queued behind them timed out without starting. Past compile_timeout a slow compile gives its slot
    back, so the quick one compiles within its own time; the slow ones still finish (and are cached)."""
    b = GrammarBackend(tok, V, [1, 4], compile_timeout=0.3, max_workers=2)
    try:
        release = threading.Event()
        real = b._compile_now
        monkeypatch.setattr(b, "_compile_now",
                            lambda spec: (spec.kind == "json_schema" and release.wait(10), real(spec))[1])
        slow = [b.compile_async(GrammarSpec.json_schema({**SCHEMA, "title": f"s{i}"})) for i in range(2)]
        start = time.monotonic()
        quick = b.compile_async(GrammarSpec.regex("a+"))
        b.result(quick, timeout=3)
        assert time.monotonic() - start < 1.5, "the quick grammar waited for the slow ones"
        assert not any(f.done() for f in slow)
        # a third slow grammar once the overrun ones fill max_overdue: it waits for a slot, it is not lost
        third = b.compile_async(GrammarSpec.json_schema({**SCHEMA, "title": "s2"}))
        release.set()
        for f in [*slow, third]:
            b.result(f, timeout=10)
        assert b._running == 0 and b._overdue == 0
    finally:
        b.close()


# Per-sequence state ----------------------------------------------------------------------------------------------

def _json_tokens(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_accept_rollback_and_drafts_match_fresh_matchers(backend, tok):
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA, whitespace="any"))  # the text below has spaces
    p = StructuredOutputProcessor(backend, V)
    p.add_request("r", grammar=compiled)
    c = p.constraint("r")
    tokens = _json_tokens(tok, '{"a": 12, "b": "xy"}')
    assert c.accept(tokens[:5])
    c.rollback(2)
    mask = xgr.allocate_token_bitmask(4, V)
    assert c.fill_row(mask, 0)
    assert allowed(mask[0]) == fresh_allowed(backend, compiled, tokens[:3])
    bad = _json_tokens(tok, "}")[0]
    drafts = tokens[3:6] + [bad] + tokens[6:8]
    assert c.validate_drafts(drafts) == 3 and c.num_seen == 3  # longest valid prefix; state unchanged
    valid, rows = c.fill_draft_rows(drafts, mask, 0)
    assert valid == 3 and rows == [0, 1, 2, 3]
    for j in range(4):  # the row before each valid draft, and the bonus row after the last one
        assert allowed(mask[j]) == fresh_allowed(backend, compiled, tokens[:3 + j])
    assert c.num_seen == 3 and c.error is None


def test_a_rejected_token_is_an_error_not_silence(backend, tok):
    p = StructuredOutputProcessor(backend, V)
    p.add_request("r", grammar=backend.compile(GrammarSpec.choice(["yes", "no"])))
    s = seq("r", _json_tokens(tok, "maybe"))
    p(torch.zeros(1, V), [s])
    assert list(p.errors()) == [("r", 0)]
    logits = torch.zeros(1, V)
    s.token_ids.append(5)
    p(logits, [s])
    assert torch.all(logits == 0)  # a failed constraint masks nothing more: the engine ends the request


# The batch mask --------------------------------------------------------------------------------------------------

def test_constrained_rows_get_their_grammar_and_the_others_are_untouched(backend, tok):
    json_g = backend.compile(GrammarSpec.json_schema(SCHEMA, whitespace="any"))
    choice_g = backend.compile(GrammarSpec.choice(["yes", "no"]))
    p = StructuredOutputProcessor(backend, V, max_rows=2)  # grows when the batch is larger
    p.add_request("json", grammar=json_g)
    p.add_request("choice", grammar=choice_g)
    prefix = _json_tokens(tok, '{"a": 1')
    seqs = [seq("free", [7, 8]), seq("json", prefix), seq("other", []), seq("choice", [])]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    p(logits, seqs)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, (compiled, pre) in {1: (json_g, prefix), 3: (choice_g, [])}.items():
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == fresh_allowed(backend, compiled, pre)
        assert torch.equal(logits[row][list(finite)], before[row][list(finite)])  # kept, not rescaled


def test_padded_vocabulary_ids_are_masked(tok):
    padded = V + 64  # an lm_head wider than the tokenizer (Phi-3, DeepSeek-V2 pad theirs)
    b = GrammarBackend(tok, padded, [1, 4])
    try:
        p = StructuredOutputProcessor(b, padded)
        p.add_request("r", grammar=b.compile(GrammarSpec.json_object()))
        logits = torch.zeros(1, padded)
        p(logits, [seq("r", [])])
        assert torch.all(torch.isinf(logits[0, V:]))
        assert torch.nonzero(torch.isfinite(logits[0])).flatten().tolist() == _json_tokens(tok, "{")[:1]
    finally:
        b.close()


END = 1000  # an id standing in for the end tag in these tests
THINK = ThinkingConfig(start_ids=(999,), end_ids=(END,), force_ids=(END,), phase=ThinkPhase.THINKING)


def test_grammar_waits_for_the_thinking_block_and_a_budget_forces_its_end(backend, tok):
    import dataclasses

    compiled = backend.compile(GrammarSpec.json_object())
    p = StructuredOutputProcessor(backend, V)
    p.add_request("think", grammar=compiled, thinking=THINK)
    p.add_request("budget", thinking=dataclasses.replace(THINK, budget=3))
    p.add_request("maybe", grammar=compiled, thinking=dataclasses.replace(THINK, phase=ThinkPhase.MAYBE))
    thinking = seq("think", [5, 6])
    budget = seq("budget", [5, 6])
    maybe = seq("maybe", [])
    logits = torch.zeros(3, V)
    p(logits, [thinking, budget, maybe])
    assert torch.all(logits[0] == 0)  # inside the block: free text
    assert torch.nonzero(torch.isfinite(logits[1])).flatten().tolist() == [END]  # the budget is spent
    assert set(torch.nonzero(torch.isfinite(logits[2])).flatten().tolist()) == \
        fresh_allowed(backend, compiled, []) | {999}  # may open a block, or answer in the grammar
    thinking.token_ids.append(END)  # the model closes the block: the grammar starts with the next token
    logits = torch.zeros(1, V)
    p(logits, [thinking])
    assert set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == fresh_allowed(backend, compiled, [])
    assert p.constraint("think").error is None


def test_placeholders_are_refused(backend):
    p = StructuredOutputProcessor(backend, V)
    p.add_request("r", grammar=backend.compile(GrammarSpec.json_object()))
    with pytest.raises(AssertionError, match="async scheduling"):
        p(torch.zeros(1, V), [seq("r", [PLACEHOLDER_TOKEN])])


def test_no_constrained_request_touches_nothing(backend):
    p = StructuredOutputProcessor(backend, V)
    logits = torch.randn(3, V)
    before = logits.clone()
    p(logits, [seq("a", [1]), seq("b", []), seq("c", [2, 3])])
    assert torch.equal(logits, before)
    p.add_request("r", grammar=backend.compile(GrammarSpec.json_object()))
    p.remove_request("r")
    p(logits, [seq("r", [])])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("spec, check", [
    (GrammarSpec.regex(r"(cat|dog)s? [0-9]{2,4}"), lambda s: re.fullmatch(r"(cat|dog)s? [0-9]{2,4}", s)),
    (GrammarSpec.choice(["alpha", "beta", 'say "hi"']), lambda s: s in ("alpha", "beta", 'say "hi"')),
    (GrammarSpec.grammar('root ::= "(" inner ")"\ninner ::= "x" | "(" inner ")"'),
     lambda s: re.fullmatch(r"(\()+x(\))+", s) and s.count("(") == s.count(")")),
    (GrammarSpec.json_schema(BOUNDED), lambda s: json.loads(s)["c"] in ("x", "y") and 0 <= json.loads(s)["a"] <= 99),
])
def test_random_masked_sampling_stays_in_the_language(backend, tok, spec, check):
    p = StructuredOutputProcessor(backend, V)
    gen = torch.Generator().manual_seed(0)
    for k in range(8):
        p.add_request(f"r{k}", grammar=backend.compile(spec))
    seqs = [seq(f"r{k}", []) for k in range(8)]
    done = [False] * 8
    for _ in range(300):
        logits = torch.randn(8, V, generator=gen) * 3
        p(logits, seqs)
        picks = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
        for k, t in enumerate(picks):
            if done[k]:
                continue
            if t in (1, 4):
                done[k] = True
            else:
                seqs[k].token_ids.append(t)
        if all(done):
            break
    assert all(done)
    for s in seqs:
        text = tok.decode(s.output_token_ids)
        assert check(text), text


def test_json_strings_stay_strict_json(backend, tok):
    """xgrammar 0.2.8 lets raw control characters into strings with minLength/maxLength, and surrogate code
    points (invalid UTF-8) into any JSON string: strict parsers reject such output. kiln corrects the string
    classes of the grammars it compiles (schemas, json_object, structural tags)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4},
                                               "t": {"type": "string"}}, "required": ["s", "t"]}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(raw, '{"s": "a\tb", "t": ""}'), "xgrammar fixed bounded strings: drop _json_strings_fixed"
    compiled = backend.compile(GrammarSpec.json_schema(schema, whitespace="any"))
    for text, ok in [('{"s": "a\tb"', False), ('{"s": "a\x0cb"', False), ('{"s": "abcd", "t": "x\ty"', False),
                     ('{"s": "abcd", "t": "\u00e9\\n ok"}', True), ('{"s": "abcde"', False), ('{"s": ""', False),
                     ('{"s": "ü", "t": "日本"}', True)]:
        assert xgr.GrammarMatcher(compiled).accept_string(text) == ok, text
    surrogate = b'{"s": "a", "t": "' + b"\xed\xa0\x80"
    assert accepts(raw, surrogate + b'"}')
    assert not xgr.GrammarMatcher(compiled).accept_string(surrogate)


def test_verification_rows_for_speculative_drafts(backend, tok):
    """Each verification row is masked as a fresh matcher at that draft position would mask it; a draft the
    grammar rejects gets no row after it, and cannot survive verification (the row before it forbids it)."""
    compiled = backend.compile(GrammarSpec.json_schema(SCHEMA))
    p = StructuredOutputProcessor(backend, V, max_rows=2)
    p.add_request("spec", grammar=compiled)
    tokens = _json_tokens(tok, '{"a": 12, "b": "xy"}')
    bad = _json_tokens(tok, "}")[0]
    s = seq("spec", tokens[:3])
    s.draft_token_ids = [tokens[3], tokens[4], bad]
    free = seq("free", [5])
    free.draft_token_ids = [6, 7]
    logits = torch.zeros(8, V)
    assert p.mask_drafts(logits, [free, s], [0, 3]) == [2, 2]
    assert torch.all(logits[:3] == 0) and torch.all(logits[6:] == 0)  # the free rows, and rows past the bad draft
    for j in range(3):
        finite = set(torch.nonzero(torch.isfinite(logits[3 + j])).flatten().tolist())
        assert finite == fresh_allowed(backend, compiled, tokens[:3 + j])
    assert bad not in set(torch.nonzero(torch.isfinite(logits[5])).flatten().tolist())
    assert p.constraint("spec").num_seen == 3  # drafts are not accepted until verified
