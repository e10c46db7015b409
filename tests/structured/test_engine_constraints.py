"""The engine core's side of constrained decoding, through SamplingParams (the path the server's requests
take): unconstrained requests are unchanged by constrained neighbours, with and without async scheduling
(which steps synchronously while a constrained request runs, then overlaps again); a grammar compiles off the
step loop while others run; a grammar that fails, or a request aborted while its grammar compiles, ends alone."""
from __future__ import annotations

import json

import pytest
from kiln.runtime.api.reasoning_parsers import get_reasoning_parser
from kiln.runtime.grammar_spec import GrammarSpec
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.thinking import ThinkingConfig, count_reasoning_tokens
from schemas import PERSON

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def make_engine(embedded_artifact):
    import torch
    from kiln.runtime.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield lambda **kw: LLMEngine(embedded_artifact, max_num_seqs=32, grammar_max_whitespace=2, **kw)
    finally:
        torch.set_num_threads(threads)


def _prompt(engine, text: str, suffix: str = "") -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]) + suffix, add_special_tokens=False)


def _run(engine, requests, late=()):
    """requests: (id, prompt, params), added at once; `late` ones after the first step. Returns id -> output."""
    for r in requests:
        engine.add_request(*r)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 1:
            for r in late:
                engine.add_request(*r)
    return done


PLAIN = [("g", SamplingParams(temperature=0.0, max_tokens=40)),
         ("s", SamplingParams(temperature=1.0, seed=7, max_tokens=40)),
         ("t", SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=40))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_unconstrained_rows_identical_to_a_run_without_constrained_requests(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    prompt = _prompt(engine, "Tell me a fortune.")
    alone = _run(engine, [(f"{r}-alone", prompt, p) for r, p in PLAIN])
    schema = GrammarSpec.json_schema(PERSON)
    thinking = ThinkingConfig.from_tokenizer(engine.tokenizer, get_reasoning_parser("think"), budget=6)
    constrained = [(f"c{i}", _prompt(engine, "Describe a person as JSON."),
                    SamplingParams(temperature=1.0, seed=100 + i, max_tokens=300, structured_output=schema))
                   for i in range(4)]
    think = [("k", _prompt(engine, "Think.", "<think>\n"), SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                                           thinking=thinking))]
    mixed = _run(engine, [(f"{r}-mixed", prompt, p) for r, p in PLAIN] + constrained[:2],
                 late=constrained[2:] + think)  # compiled while the others decode
    for r, _ in PLAIN:
        assert mixed[f"{r}-mixed"].outputs[0].token_ids == alone[f"{r}-alone"].outputs[0].token_ids
    for i in range(4):
        out = mixed[f"c{i}"].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert count_reasoning_tokens(thinking, mixed["k"].outputs[0].token_ids) <= 6
    stats = engine.stats()
    assert stats["num_masked_rows"] > 0 and stats["num_constrained_requests"] == 0
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_bad_grammar_and_abort_while_compiling_end_alone(make_engine):
    engine = make_engine()
    prompt = _prompt(engine, "Hello")
    engine.add_request("ok", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    engine.add_request("bad", prompt, SamplingParams(max_tokens=12, structured_output=GrammarSpec.regex("a{2")))
    # a schema never seen: its compile is still running when the request is aborted
    odd = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
    engine.add_request("gone", prompt, SamplingParams(max_tokens=12, structured_output=GrammarSpec.json_schema(odd)))
    engine.abort_request("gone")
    done = _run(engine, [])
    assert done["bad"].outputs[0].finish_reason == "error" and "invalid regex" in done["bad"].error
    assert done["ok"].outputs[0].finish_reason == "length" and done["ok"].error is None
    assert done["gone"].outputs[0].finish_reason == "abort" and done["gone"].outputs[0].token_ids == []
    stats = engine.stats()
    assert stats["num_grammar_pending"] == 0 and stats["num_constrained_requests"] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
