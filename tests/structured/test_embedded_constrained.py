"""Constrained decoding end to end on the embedded model (compiled by the test), through the sampler's logits-
processor hook: a nested json_schema validates on 50 of 50 requests sampled at temperature 1.0; unconstrained
requests sharing the batch are unchanged; tool_choice="required" yields calls whose arguments fit the tool's
schema, streamed and whole alike; a thinking budget of N gives at most N reasoning tokens, then the answer —
constrained by the request's schema once the thinking block has ended."""
from __future__ import annotations

import json

import pytest
from kiln.runtime.api.reasoning_parsers import get_reasoning_parser
from kiln.runtime.api.tool_parsers import get_tool_parser, tool_choice_grammar
from kiln.runtime.core.structured_output import (
    GrammarBackend,
    GrammarSpec,
    StructuredOutputProcessor,
    eos_token_ids,
)
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.thinking import ThinkingConfig, count_reasoning_tokens
from kiln.runtime.tokenizer import IncrementalDetokenizer
from schemas import PERSON, TOOLS

jsonschema = pytest.importorskip("jsonschema")

@pytest.fixture(scope="module")
def engine(embedded_artifact):
    import torch
    from kiln.runtime.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and OpenMP spinning on a shared CPU is not
    try:
        e = LLMEngine(embedded_artifact, max_num_seqs=64)
        assert not e.async_scheduling and e.speculative is None  # what the phase-1 hook supports
        yield e
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend(engine):
    # A small model spends its tokens on whitespace wherever the grammar allows it: 2 per gap keeps the 50
    # outputs well inside max_tokens (the server's setting; the default is 8).
    b = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size,
                       eos_token_ids(engine.model_config.eos_token_ids, engine.tokenizer), max_whitespace=2)
    yield b
    b.close()


@pytest.fixture
def processor(engine, backend):
    p = StructuredOutputProcessor(backend, engine.model_config.vocab_size)
    engine.sampler.logits_processor = p
    try:
        yield p
    finally:
        engine.sampler.logits_processor = None


def chat_prompt(engine, text: str, suffix: str = "") -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]) + suffix, add_special_tokens=False)


def constrained(processor, name: str, n: int, prompt: list[int], max_tokens: int, **constraints) -> list[tuple]:
    """n requests `name-i` (seed i, temperature 1.0) registered with the processor's constraints."""
    requests = []
    for i in range(n):
        processor.add_request(f"{name}-{i}", **constraints)
        requests.append((f"{name}-{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens)))
    return requests


def run(engine, requests):
    """requests: (request_id, prompt ids, SamplingParams); returns request_id -> CompletionOutput."""
    done = {}
    try:
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    finally:
        for request_id, _, _ in requests:
            engine.abort_request(request_id)
        engine.drain_aborted()
    return done


def test_json_schema_validates_50_of_50_at_temperature_1(engine, backend, processor):
    compiled = backend.compile(GrammarSpec.json_schema(PERSON, strict=True))
    prompt = chat_prompt(engine, "Describe a person as JSON.")
    outs = run(engine, constrained(processor, "person", 50, prompt, 400, grammar=compiled))
    texts = []
    for i in range(50):
        out = outs[f"person-{i}"]
        assert out.finish_reason == "stop", out.text  # ended by EOS, which the grammar allowed only at the end
        jsonschema.validate(json.loads(out.text), PERSON)
        texts.append(out.text)
    assert len(set(texts)) > 40  # genuinely sampled, not one answer repeated
    assert processor.errors() == {}


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(engine, backend, processor):
    prompt = chat_prompt(engine, "Tell me a fortune.")
    plain = [("g", SamplingParams(temperature=0.0, max_tokens=48)),
             ("s", SamplingParams(temperature=1.0, seed=7, max_tokens=48)),
             ("t", SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=48))]
    alone = run(engine, [(f"{r}-alone", prompt, p) for r, p in plain])
    compiled = backend.compile(GrammarSpec.json_schema(PERSON))
    mixed_requests = [(f"{r}-mixed", prompt, p) for r, p in plain]
    for i in range(5):
        processor.add_request(f"c{i}", grammar=compiled)
        mixed_requests.append((f"c{i}", prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=300)))
    mixed = run(engine, mixed_requests)
    for r, _ in plain:
        assert mixed[f"{r}-mixed"].token_ids == alone[f"{r}-alone"].token_ids
    assert processor.num_masked_rows > 0
    for i in range(5):
        jsonschema.validate(json.loads(mixed[f"c{i}"].text), PERSON)


def _streamed_calls(engine, parser, token_ids):
    """The calls a server streaming this output would send: per-token text deltas from the incremental
    detokenizer, fed to the parser's stream."""
    detok = IncrementalDetokenizer(engine.tokenizer, [], skip_special_tokens=not parser.needs_special_tokens)
    stream = parser.stream()
    deltas = [stream.feed(detok.add_tokens([t])) for t in token_ids] + [stream.finish()]
    assert stream.consistent
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            calls.setdefault(piece.index, [piece.name, ""])[1] += piece.arguments
    return [tuple(calls[i]) for i in sorted(calls)], "".join(d.content for d in deltas)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_tool_calls_parse_and_fit_the_schema(engine, backend, processor, choice):
    parser = get_tool_parser("hermes")
    compiled = backend.compile(tool_choice_grammar(parser, TOOLS, choice, parallel_tool_calls=False))
    prompt = chat_prompt(engine, "What is the weather in Paris?")
    outs = run(engine, constrained(processor, "tool", 10, prompt, 200, grammar=compiled))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i in range(10):
        out = outs[f"tool-{i}"]
        assert out.finish_reason == "stop"
        result = parser.parse(out.text)
        assert len(result.tool_calls) == 1  # required: at least one; parallel_tool_calls=False: at most one
        call = result.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        streamed, content = _streamed_calls(engine, parser, out.token_ids)
        assert streamed == [(call.name, call.arguments)] and content == (result.content or "")


def _thinking(engine, budget: int | None) -> ThinkingConfig:
    return ThinkingConfig.from_tokenizer(engine.tokenizer, get_reasoning_parser("think"), phase="thinking",
                                         budget=budget)


@pytest.mark.parametrize("budget", [10, 24])
def test_thinking_budget_bounds_reasoning_then_the_answer_comes(engine, processor, budget):
    """The prompt opens a thinking block (as thinking-by-default templates do); the embedded model never
    learned to close it, so without a budget it thinks until max_tokens."""
    prompt = chat_prompt(engine, "Tell me a fortune.", suffix="<think>\n")
    parser = get_reasoning_parser("think")
    cfg = _thinking(engine, budget)
    assert len(cfg.end_ids) > 1  # "</think>" is several tokens in this vocabulary: forced one by one
    requests = constrained(processor, "think", 6, prompt, budget + 40, thinking=cfg)
    requests.append(("unbounded", prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=budget + 40,
                                                         ignore_eos=True)))
    outs = run(engine, requests)
    answered = 0
    for i in range(6):
        out = outs[f"think-{i}"]
        n = count_reasoning_tokens(cfg, out.token_ids)
        assert n <= budget
        state = processor.constraint(f"think-{i}")  # advanced before each sample: it lacks the last token
        assert state.num_seen == len(out.token_ids) - 1
        assert state.tracker.count == count_reasoning_tokens(cfg, out.token_ids[:state.num_seen])
        if "</think>" in out.text:
            answered += bool(parser.parse(out.text, prompt_in_thinking=True).content)
        else:  # the model ended the whole output while thinking, before the budget
            assert out.finish_reason == "stop" and n == len(out.token_ids) < budget
    assert answered >= 3  # the answer comes after the forced end
    unbounded = outs["unbounded"]
    assert count_reasoning_tokens(cfg, unbounded.token_ids) == len(unbounded.token_ids) == budget + 40


def test_budget_then_schema_in_the_answer(engine, backend, processor):
    """A reasoning request with response_format: free thinking (at most the budget), then JSON that validates."""
    prompt = chat_prompt(engine, "Describe a person as JSON.", suffix="<think>\n")
    compiled = backend.compile(GrammarSpec.json_schema(PERSON))
    cfg = _thinking(engine, 12)
    outs = run(engine, constrained(processor, "both", 8, prompt, 320, grammar=compiled, thinking=cfg))
    parser = get_reasoning_parser("think")
    for i in range(8):
        out = outs[f"both-{i}"]
        assert out.finish_reason == "stop"
        assert count_reasoning_tokens(cfg, out.token_ids) <= 12
        split = parser.parse(out.text, prompt_in_thinking=True)
        jsonschema.validate(json.loads(split.content), PERSON)
