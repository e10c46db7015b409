"""Tools through real chat templates (Llama 3.1, Qwen2.5, Qwen3-Thinking-2507, Mistral v0.3, DeepSeek-V3):
kiln renders a tool round trip exactly as transformers' apply_chat_template does; what a template teaches the
model to write for a call parses back to that call; the family's structural tag for tool_choice="required"
accepts that text and, under random masked sampling, only ever yields calls whose arguments fit the schema."""
from __future__ import annotations

import json
import random

import pytest
import torch
from kiln.runtime.api.chat_template import prepare_messages, render_chat
from kiln.runtime.api.reasoning_parsers import get_reasoning_parser
from kiln.runtime.api.tool_parsers import get_tool_parser, tool_choice_grammar, tool_parser_for
from kiln.runtime.core.structured_output import GrammarBackend, eos_token_ids

jsonschema = pytest.importorskip("jsonschema")

FAMILY_NAMES = ["llama3_1", "qwen2_5", "qwen3_thinking_2507", "mistral_v0_3", "deepseek_v3"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}},
                                               "required": ["zone"], "additionalProperties": False}}}]
ARGS = {"city": "Paris", "unit": "celsius"}


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc123", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "21 degrees and sunny"},
    ]


def hf_messages(messages: list[dict], family: str, parser) -> list[dict]:
    """The same conversation the way an HF user passes it: arguments as a dict (DeepSeek's template
    concatenates them, so a string there), Mistral's 9-character ids."""
    out = []
    for m in prepare_messages(messages, parser):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = dict(c["function"]["arguments"])
                calls.append({**c, "function": {**c["function"],
                                                "arguments": json.dumps(args) if family == "deepseek_v3" else args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def assistant_turn(tok, parser, messages: list[dict]) -> str:
    """What the template writes for the assistant's tool-call turn after the generation prompt, up to the end
    of the turn: the text the model is taught to produce."""
    before = render_chat(tok.kiln, messages[:2], TOOLS, parser=parser, add_generation_prompt=True)
    after = render_chat(tok.kiln, messages[:3], TOOLS, parser=parser, add_generation_prompt=False)
    assert after.startswith(before), "the template's generation prompt does not prefix the assistant turn"
    return after[len(before):].split(tok.family.eos)[0]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_kiln_renders_tools_like_transformers(family_tokenizer, family):
    tok = family_tokenizer(family)
    parser = get_tool_parser(tok.family.parser)
    messages = conversation()
    ours = render_chat(tok.kiln, messages, TOOLS, parser=parser, add_generation_prompt=True)
    if family == "deepseek_v3":
        # DeepSeek-V3's template marks a tool-call turn by `content is none`; transformers >= 5 drops None-valued
        # keys before rendering, so it cannot render this turn at all (UndefinedError). kiln keeps the None:
        # the turn as the template spells it (V3's original template closes `<｜tool▁calls▁end｜>` only after a
        # second call: a single call is left open).
        call = ('<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21 degrees and sunny<｜tool▁output▁end｜>'
                '<｜tool▁outputs▁end｜>')
        assert ours == "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the weather in Paris?" + call
        return
    theirs = tok.hf.apply_chat_template(hf_messages(messages, family, parser), tools=TOOLS, tokenize=False,
                                        add_generation_prompt=True)
    assert ours == theirs
    assert "get_weather" in ours and "21 degrees and sunny" in ours  # the tools and the tool result are in it


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_template_implies_its_parser(family_tokenizer, family):
    tok = family_tokenizer(family)
    assert tool_parser_for(tok.template) == tok.family.parser


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_what_the_template_teaches_parses_back(family_tokenizer, family):
    tok = family_tokenizer(family)
    parser = get_tool_parser(tok.family.parser)
    text = assistant_turn(tok, parser, conversation())
    if family == "qwen3_thinking_2507":  # the prompt opened <think>: the reasoning parser goes first
        split = get_reasoning_parser("qwen3").parse(text, prompt_in_thinking=True)
        assert split.reasoning is None
        text = split.content
    result = parser.parse(text)
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert json.loads(result.tool_calls[0].arguments) == ARGS
    assert result.content is None
    # The markers survive detokenization exactly when the parser says so (skip_special_tokens=False needed).
    ids = tok.kiln.encode(text, add_special_tokens=False)
    assert tok.kiln.decode(ids, skip_special_tokens=False) == text
    kept = parser.parse(tok.kiln.decode(ids, skip_special_tokens=True)).tool_calls
    assert bool(kept) != parser.needs_special_tokens


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_multi_turn_history_round_trips(family_tokenizer, family):
    """An assistant message with tool_calls and the tool's answer render into the prompt, and the client's id
    links them (Mistral's template insists on 9-character ids: kiln maps the client's id consistently)."""
    tok = family_tokenizer(family)
    parser = get_tool_parser(tok.family.parser)
    prepared = prepare_messages(conversation(), parser)
    if parser.tool_call_id_length:
        call_id = prepared[2]["tool_calls"][0]["id"]
        assert len(call_id) == 9 and call_id.isalnum() and prepared[3]["tool_call_id"] == call_id
    prompt = render_chat(tok.kiln, conversation(), TOOLS, parser=parser)
    assert prompt.index("get_weather") < prompt.index("21 degrees and sunny")


def _reasoning_mode(family: str) -> str:
    return "enabled" if family == "qwen3_thinking_2507" else "disabled"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_required_tag_accepts_the_templates_call(family_tokenizer, family):
    import xgrammar as xgr

    tok = family_tokenizer(family)
    parser = get_tool_parser(tok.family.parser)
    eos = eos_token_ids([], tok.kiln)
    backend = GrammarBackend(tok.kiln, tok.kiln.vocab_size, eos)
    try:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            spec = tool_choice_grammar(parser, TOOLS, choice, reasoning=_reasoning_mode(family))
            matcher = xgr.GrammarMatcher(backend.compile(spec))
            text = assistant_turn(tok, parser, conversation())
            if family == "deepseek_v3":  # the template leaves a lone call open; the model closes the calls block
                text = text.split("<｜tool▁outputs▁begin｜>")[0] + parser.calls_end
            assert matcher.accept_string(text), f"{family}: the grammar rejects the template's own call: {text!r}"
            assert matcher.accept_token(eos[0]) and matcher.is_terminated()
        named = tool_choice_grammar(parser, TOOLS, {"type": "function", "function": {"name": "get_time"}},
                                    reasoning=_reasoning_mode(family))
        assert not xgr.GrammarMatcher(backend.compile(named)).accept_string(text)  # the wrong function
    finally:
        backend.close()


def _sample_masked(backend: GrammarBackend, compiled, rng: random.Random, max_steps: int = 4000) -> list[int]:
    """Random logits, masked by the grammar, sampled at temperature 1: the grammar alone shapes the output."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, backend.vocab_size, generator=gen) * 2
        matcher.fill_next_token_bitmask(mask, 0)
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return out
        out.append(token)
    raise AssertionError("the grammar did not end within the step limit")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_required_is_enforced_under_random_sampling(family_tokenizer, family):
    tok = family_tokenizer(family)
    parser = get_tool_parser(tok.family.parser)
    backend = GrammarBackend(tok.kiln, tok.kiln.vocab_size, eos_token_ids([], tok.kiln))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(family)
    try:
        compiled = backend.compile(tool_choice_grammar(parser, TOOLS, "required", reasoning=_reasoning_mode(family)))
        for _ in range(5):
            text = tok.kiln.decode(_sample_masked(backend, compiled, rng), skip_special_tokens=False)
            if family == "qwen3_thinking_2507":
                text = get_reasoning_parser("qwen3").parse(text, prompt_in_thinking=True).content or ""
            calls = parser.parse(text).tool_calls
            assert calls, f"{family}: no tool call in {text!r}"
            for call in calls:
                assert call.complete
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    finally:
        backend.close()


def test_unknown_tool_and_bad_arguments_are_request_errors(family_tokenizer):
    from kiln.runtime.errors import RequestError

    parser = get_tool_parser("hermes")
    with pytest.raises(RequestError, match="not found"):
        tool_choice_grammar(parser, TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestError, match="required"):
        tool_choice_grammar(parser, [], "required")
    bad = conversation()
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(RequestError, match=r"messages\[2\].tool_calls\[0\].function.arguments"):
        prepare_messages(bad, parser)
    assert tool_choice_grammar(parser, TOOLS, "none") is None
    assert tool_choice_grammar(parser, TOOLS, "auto") is None  # no strict tool: parsed, not constrained
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    assert tool_choice_grammar(parser, strict, "auto").kind == "structural_tag"
