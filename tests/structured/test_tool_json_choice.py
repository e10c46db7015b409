"""Tool calls without a parser (issue 32 item 2): on a model whose chat template has no tool format kiln knows
(the embedded model's), tool_choice "required" and a named function are constrained to the calls' JSON and come
back as `tool_calls`, through the official `openai` client, streamed and whole; "auto" is still a 400 that says
why. `parallel_tool_calls: false` keeps one call in every mode, a family parser's "auto" included."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from schemas import TOOLS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import LiveServer  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

MODEL = "embedded"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def server(embedded_artifact):
    s = LiveServer(embedded_artifact, {"max_num_seqs": 16}, served_model_name=MODEL)  # no --tool-parser
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_calls(client, **kwargs) -> tuple[dict[int, list], str | None, str]:
    """{index: [id, name, arguments]}, the finish reason and the content of a streamed request."""
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, [None, None, ""])
            if d.id:
                assert entry[0] is None, "a call's id comes once"
                entry[0] = d.id
            if d.function.name:
                entry[1] = d.function.name
            entry[2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


def check_call(name: str, arguments: str, call_id: str) -> None:
    assert call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_template_has_no_tool_format(server):
    assert server.server_state.tool_parser is None


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_calls_are_valid_streamed_and_whole(client, choice):
    """parallel_tool_calls false: with it true this small model goes on adding calls to the array until
    max_tokens (the grammar with it true is checked in test_required_grammar_shape_and_parse)."""
    parallel = False
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=160,
                      temperature=1.0, seed=seed, parallel_tool_calls=parallel)
        c = client.chat.completions.create(**kwargs).choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content
        calls = c.message.tool_calls
        assert calls and (len(calls) == 1 or (parallel and choice == "required"))
        for call in calls:
            assert call.type == "function"
            check_call(call.function.name, call.function.arguments, call.id)
            if choice == NAMED:
                assert call.function.name == "get_time"
        streamed, finish, content = streamed_calls(client, **kwargs)
        assert finish == "tool_calls" and not content and streamed
        assert len(streamed) == 1 or (parallel and choice == "required")
        for call_id, name, arguments in streamed.values():
            check_call(name, arguments, call_id)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_equals_whole_at_temperature_0(client, choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=160, temperature=0,
                  parallel_tool_calls=False)
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls"
    whole = c.message.tool_calls
    for call in whole:
        check_call(call.function.name, call.function.arguments, call.id)
    streamed, _, _ = streamed_calls(client, **kwargs)
    assert [(c.function.name, c.function.arguments) for c in whole] == [(n, a) for _, n, a in streamed.values()]


def test_auto_without_a_parser_is_a_400_that_says_why(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8)
    assert "tool_choice 'auto' needs a tool-call format" in str(e.value) and "'required'" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="get_nothing"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_nothing"}})


# Without a server ------------------------------------------------------------------------------------------------

def _plan(**req):
    from kiln.runtime.api.chat_plan import plan_chat
    from kiln.runtime.api.protocol import ChatCompletionRequest
    from kiln.runtime.api.tool_parsers import get_tool_parser

    parser = req.pop("parser", None)
    r = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **req})
    return plan_chat(r, "", None, get_tool_parser(parser) if parser else None, None)


def _feed(plan, text: str):
    parser = plan.choice_parser()
    calls: dict[int, list] = {}
    for k in range(0, len(text), 3):
        for d in parser.feed(text[k:k + 3], final=k + 3 >= len(text)).tool_calls:
            entry = calls.setdefault(d["index"], ["", ""])
            entry[0] = d["function"].get("name") or entry[0]
            entry[1] += d["function"]["arguments"]
    return calls


def test_required_grammar_shape_and_parse():
    from kiln.runtime.core.structured_output import json_grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    one, many = _plan(tool_choice="required", parallel_tool_calls=False), _plan(tool_choice="required")
    two = '[{"name":"get_time","arguments":{"zone":"UTC"}},{"name":"get_weather","arguments":{"city":"P","days":2}}]'
    assert accepts(json_grammar(many.grammar), two) and not accepts(json_grammar(one.grammar), two)
    assert not accepts(json_grammar(many.grammar), "[]")
    assert not accepts(json_grammar(many.grammar), '[{"name":"get_time","arguments":{"zone":"UTC"},"x":1}]')
    assert not accepts(json_grammar(many.grammar), '[{"name":"get_tim","arguments":{"zone":"UTC"}}]')
    assert not accepts(json_grammar(many.grammar), '[{"name":"get_time","arguments":{"zone":"EST"}}]')
    out = many.choice_parser().parse(two)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "P", "days": 2})]
    assert out.content is None
    assert _feed(many, two) == {0: ["get_time", '{"zone":"UTC"}'], 1: ["get_weather", '{"city":"P","days":2}']}
    named = _plan(tool_choice=NAMED)
    assert accepts(json_grammar(named.grammar), '{"zone":"CET"}')
    assert not accepts(json_grammar(named.grammar), '{"city":"P","days":2}')
    assert _feed(named, '{"zone":"CET"}') == {0: ["get_time", '{"zone":"CET"}']}


def test_parallel_tool_calls_false_keeps_one_call_under_auto_with_a_family_parser():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "days": 1}}\n</tool_call>')
    both = _plan(parser="hermes")
    assert len(both.choice_parser().parse(text).tool_calls) == 2 and len(_feed(both, text)) == 2
    one = _plan(parser="hermes", parallel_tool_calls=False)
    assert [c["function"]["name"] for c in one.choice_parser().parse(text).tool_calls] == ["get_time"]
    assert list(_feed(one, text)) == [0]


def test_shared_defs_are_lifted_and_conflicts_refused():
    from kiln.runtime.api.chat_plan import PlanError

    tz = {"type": "object", "properties": {"z": {"$ref": "#/$defs/Z"}}, "required": ["z"],
          "$defs": {"Z": {"enum": ["UTC"]}}}
    other = {**tz, "$defs": {"Z": {"enum": ["CET"]}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": tz}},
             {"type": "function", "function": {"name": "b", "parameters": tz}}]
    plan = _plan(tools=tools, tool_choice="required")
    assert json.loads(plan.grammar.spec)["$defs"] == {"Z": {"enum": ["UTC"]}}
    tools[1]["function"]["parameters"] = other
    with pytest.raises(PlanError, match="define \\$defs/Z differently"):
        _plan(tools=tools, tool_choice="required")
