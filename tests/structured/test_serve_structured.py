"""Structured output, tool calling and thinking budgets through the live server (`kiln serve`'s two processes) on
the embedded model, with the official `openai` client: `chat.completions.parse` with a pydantic model, a nested
json_schema that validates on 50 of 50 requests sampled at temperature 1.0, `tool_choice="required"` giving
calls whose arguments fit the tool's schema, streamed and whole answers that agree, a thinking budget on a copy
of the model whose chat template opens a thinking block, and bad grammars answered 400 with xgrammar's reason.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import pytest
from schemas import PERSON, TOOLS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import LiveServer  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "embedded"
ENGINE = {"grammar_max_whitespace": 2, "max_num_seqs": 64}  # see test_embedded_constrained's backend fixture
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
# the thinking server's reasoning_effort table (as a recipe's serve.reasoning_effort or --reasoning-effort set it)
EFFORTS = {"low": 6, "high": 24, "deep": 32}

# A template that opens a thinking block (as Qwen3-Thinking-2507's does) and drops past turns' thinking.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def server(embedded_artifact):
    s = LiveServer(embedded_artifact, ENGINE, tool_parser="hermes", served_model_name=MODEL)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thinking_server(embedded_artifact, tmp_path_factory):
    art = tmp_path_factory.mktemp("thinking") / MODEL
    shutil.copytree(embedded_artifact, art)
    config_path = art / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    s = LiveServer(art, ENGINE, served_model_name=MODEL, reasoning_efforts=EFFORTS)
    try:
        yield s
    finally:
        s.stop()


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(pattern="^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["red", "green", "blue"]] = pydantic.Field(min_length=1, max_length=3)


def test_parse_with_a_pydantic_model_returns_a_valid_object(client):
    for seed in range(3):
        completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person,
                                                   max_tokens=400, temperature=1.0, seed=seed)
        message = completion.choices[0].message
        assert isinstance(message.parsed, Person), message.content
        assert Person.model_validate_json(message.content) == message.parsed


def test_json_schema_validates_on_50_of_50_requests_at_temperature_1(client, server):
    def one(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(PERSON),
                                           max_tokens=400, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(50)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 40  # sampled, not one answer repeated
    server.wait_idle()


def test_responses_text_format_json_schema_validates_streamed_and_whole(client):
    """/v1/responses' text.format goes through the same grammar as chat's response_format."""
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for temperature in (1.0, 1.0, 0.0):
        out = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], text=fmt, max_output_tokens=400,
                                      temperature=temperature)
        assert out.status == "completed", out.status
        jsonschema.validate(json.loads(out.output_text), PERSON)
    streamed = "".join(e.delta for e in client.responses.create(
        model=MODEL, input=MESSAGES[0]["content"], text=fmt, max_output_tokens=400, temperature=0.0,
        stream=True) if e.type == "response.output_text.delta")
    assert streamed == out.output_text  # the greedy one


def test_streamed_and_whole_answers_agree(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, response_format=_schema_format(PERSON), max_tokens=400,
                  temperature=1.0, seed=11)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_other_response_formats_on_both_endpoints(client):
    # json_object leaves a string's length open: at temperature 1 the embedded model may write one past max_tokens
    # (a `length` finish, cut mid-string). Every answer that stopped is one JSON object, and most stop.
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=1.0,
                                           seed=seed, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            finished += 1
    assert finished >= 2, finished
    r = client.completions.create(model=MODEL, prompt="The date is", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"response_format": {"type": "regex", "regex": "20[0-9]{2}-[01][0-9]"}})
    assert r.choices[0].text[:4].startswith("20") and len(r.choices[0].text) == 7
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"response_format": {"type": "choice", "choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"response_format": {"type": "grammar",
                                                                  "grammar": 'root ::= ("a" | "b")+ "."'}})
    text = r.choices[0].text
    assert text.endswith(".") and set(text[:-1]) <= {"a", "b"} and text[:-1]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_and_fit_the_schema_streamed_and_whole(client, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=200, temperature=1.0,
                      seed=seed)
        r = client.chat.completions.create(**kwargs)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        [call] = c.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        names, args, finish = {}, {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for d in chunk.choices[0].delta.tool_calls or []:
                if d.function.name:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert names == {0: call.function.name} and args == {0: call.function.arguments}


def test_tool_messages_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"


def test_bad_grammars_and_tools_are_400_with_the_reason(server, client):
    import httpx

    url = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}},
         "response_format", "invalid json_schema"),
        ({"response_format": {"type": "regex", "regex": "("}}, "response_format", "parenthesis"),
        ({"response_format": {"type": "grammar", "grammar": "root ::= undefined_rule"}}, "response_format",
         "invalid grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format", "unknown response_format type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"max_thinking_tokens": 8}, "max_thinking_tokens", "reasoning model"),
    ]
    for extra, param, words in cases:
        r = httpx.post(url, json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (extra, error)
    # the server is unharmed
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()


def _metric(server, name: str) -> float:
    import httpx

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("budget", [8, 20])
def test_thinking_budget_bounds_reasoning_then_the_answer_comes(thinking_server, budget):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _metric(thinking_server, "kiln:reasoning_tokens_total")
    total, answered = 0, 0
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a fortune."}],
                                           max_tokens=budget + 40, temperature=1.0, seed=seed,
                                           extra_body={"max_thinking_tokens": budget})
        reasoning = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < reasoning <= budget
        total += reasoning
        message = r.choices[0].message
        assert message.reasoning_content and "<think>" not in message.reasoning_content
        assert "</think>" not in (message.content or "")
        answered += bool(message.content) and reasoning == budget  # forced closed, then answered
    assert answered >= 3
    assert _metric(thinking_server, "kiln:reasoning_tokens_total") - before == total


def test_reasoning_streamed_and_whole_agree_and_effort_maps_to_a_budget(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a fortune."}], max_tokens=48,
                  temperature=1.0, seed=5, extra_body={"max_thinking_tokens": 16})
    whole = client.chat.completions.create(**kwargs)
    reasoning, content, usage = "", "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        usage = chunk.usage or usage
    assert reasoning == whole.choices[0].message.reasoning_content
    assert content == (whole.choices[0].message.content or "")
    assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens_details.reasoning_tokens
    # reasoning_effort "none" closes the block at once: no reasoning but the forced end tag, then the answer
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=30,
                                       temperature=0, reasoning_effort="none")
    tok = thinking_server.server_state.tokenizer
    forced = len(tok.encode("\n", add_special_tokens=False) + tok.encode("</think>", add_special_tokens=False))
    assert r.usage.completion_tokens_details.reasoning_tokens == forced  # just the forced "\n</think>"
    assert r.choices[0].message.content


def test_thinking_then_schema_in_the_answer(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=_schema_format(PERSON),
                                           max_tokens=400, temperature=1.0, seed=seed,
                                           extra_body={"max_thinking_tokens": 12})
        assert r.usage.completion_tokens_details.reasoning_tokens <= 12
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("effort", ["low", "high", "deep"])
def test_reasoning_effort_budgets_come_from_the_servers_table(thinking_server, effort):
    """The server's table, not the defaults (low = 1024 would let the model think up to max_tokens here), on both
    chat completions and the Responses API; an effort it does not know is a 400 naming the field."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    budget, forced = EFFORTS[effort], 0
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a fortune."}],
                                           max_tokens=budget + 30, temperature=1.0, seed=seed, reasoning_effort=effort)
        reasoning = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < reasoning <= budget
        forced += reasoning == budget
        out = client.responses.create(model=MODEL, input="Tell me a fortune.", max_output_tokens=budget + 30,
                                      temperature=1.0, reasoning={"effort": effort})
        assert 0 < out.usage.output_tokens_details.reasoning_tokens <= budget
        assert out.reasoning.effort == effort
    assert forced >= 2  # the model rarely ends its thinking that early on its own: the budget did
    for url, body, param in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "max"},
             "reasoning_effort"),
            ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "max"}}, "reasoning.effort")]:
        r = httpx.post(thinking_server.url + url, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "deep" in r.json()["error"]["message"]  # it lists the server's efforts


def test_responses_reasoning_item_streamed_and_whole(thinking_server):
    """A reasoning model's thinking is a `reasoning` output item before the message, in the whole response and as
    reasoning_text events; the answer (not the thinking) is what the next turn continues."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, input="Tell me a fortune.", max_output_tokens=60, temperature=0.0,
                  reasoning={"effort": "high"})
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"], whole.output
    thought = whole.output[0].content[0].text
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert "</think>" not in whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= EFFORTS["high"]
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} <= {1}
    final = events[-1].response
    assert final.status == whole.status and [i.type for i in final.output] == ["reasoning", "message"]
    follow = client.responses.create(model=MODEL, input="And another?", previous_response_id=whole.id,
                                     max_output_tokens=8, temperature=0.0, reasoning={"effort": "low"})
    assert follow.status in ("completed", "incomplete")
    echoed = [{"role": "user", "content": "Tell me a fortune."},
              *[item.model_dump(exclude_none=True) for item in whole.output],  # the reasoning item is left out
              {"role": "user", "content": "And another?"}]
    again = client.responses.create(model=MODEL, input=echoed, max_output_tokens=8, temperature=0.0,
                                    reasoning={"effort": "low"})
    assert again.output_text == follow.output_text  # the same conversation as previous_response_id's


def _slow_grammar_compiles(engine, seconds, timeout):
    """In the engine core: every grammar compile first sleeps `seconds` (0: as before) and a compile may take
    `timeout` seconds before its request fails."""
    import time as _time

    from kiln.runtime.core import structured_output

    cls = structured_output.GrammarBackend
    real = cls.__dict__.get("_kiln_real_compile_now") or cls._compile_now
    cls._kiln_real_compile_now = real

    def slow(self, spec):
        _time.sleep(seconds)
        return real(self, spec)
    cls._compile_now = slow if seconds else real
    engine.constraints.compile_timeout = timeout


def test_a_grammar_compile_timeout_is_a_500_and_an_invalid_schema_a_400(server):
    """A grammar that does not compile within the bound is the server's failure to serve it (500, server_error,
    streamed: an error event), on both APIs; an invalid schema is the client's (400 naming the field); the server
    is unharmed either way."""
    server.in_engine(_slow_grammar_compiles, 3.0, 0.3)
    try:
        for i, stream in enumerate((False, True)):
            fmt = {"type": "regex", "regex": f"timeout-{i}-[0-9]+"}  # a grammar not in the cache
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 8, "response_format": fmt, "stream": stream})
            if stream:
                assert r.status_code == 200  # the stream began: the failure is its last event
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                error = events[-1]["error"]
                assert r.text.rstrip().endswith("data: [DONE]")
            else:
                assert r.status_code == 500, r.text
                error = r.json()["error"]
            assert error["type"] == "server_error" and "took longer than 0.3 s" in error["message"], error
        schema = {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object", "properties": {
            "slow": {"type": "string", "pattern": "^timeout-[0-9]+$"}}}}}
        r = httpx.post(server.url + "/v1/responses", timeout=30,
                       json={"model": MODEL, "input": "Hi", "max_output_tokens": 8, "text": schema})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        schema["format"]["schema"]["properties"]["slow"]["pattern"] = "^timeout-[a-z]+$"
        r = httpx.post(server.url + "/v1/responses", timeout=30,
                       json={"model": MODEL, "input": "Hi", "max_output_tokens": 8, "text": schema, "stream": True})
        failed = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]
        assert failed["type"] == "response.failed" and "took longer than" in failed["response"]["error"]["message"]
    finally:
        server.in_engine(_slow_grammar_compiles, 0, 10.0)
    bad = {"format": {"type": "json_schema", "name": "p", "schema": {"type": "wizard"}}}
    r = httpx.post(server.url + "/v1/responses", timeout=30,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 8, "text": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert "invalid json_schema" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 8, "response_format": {"type": "regex", "regex": "("}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, "response_format": {"type": "regex", "regex": "ok[0-9]"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].startswith("ok")
    server.wait_idle()


def _nested_schema(width: int, depth: int, inner: dict) -> dict:
    """`depth` nested objects of `width` integer properties each, `inner` at the bottom: xgrammar's conversion
    of it takes seconds and fails only when it reaches an invalid `inner`."""
    schema = inner
    for _ in range(depth):
        schema = {"type": "object", "properties": {**{f"p{i}": {"type": "integer"} for i in range(width)},
                                                   "child": schema}, "required": ["child"]}
    return schema


def test_huge_schemas_beside_a_stream_leave_it_flowing_and_an_oversized_one_is_a_400_at_once(server):
    """Issue 29 item 10: response_format was validated on the API server's event loop, so four big schemas
    (seconds of xgrammar work each) froze every stream. They are validated on a pool of their own now, and a
    schema over grammar_spec.MAX_GRAMMAR_CHARS is refused before any work."""
    from kiln.runtime.grammar_spec import MAX_GRAMMAR_CHARS

    url = server.url + "/v1/chat/completions"
    big = _schema_format(_nested_schema(300, 25, {"type": "wizard"}))  # about 216 KB: under the limit
    assert len(json.dumps(big)) < MAX_GRAMMAR_CHARS
    oversized = _schema_format(_nested_schema(300, 95, {"type": "string"}))  # about 820 KB: 36 s to convert
    def huge(fmt: dict) -> tuple[int, dict, float]:
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "response_format": fmt})
        start = time.monotonic()
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=120)
        return r.status_code, r.json(), time.monotonic() - start

    status, body, took = huge(oversized)
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "over the limit" in body["error"]["message"] and took < 1.0, (took, body)
    gaps: list[float] = []
    ended: list[float] = []
    with server.slow_steps(0.03):
        def stream() -> None:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            ended.append(time.monotonic())

        with ThreadPoolExecutor(6) as pool:
            streaming = pool.submit(stream)
            time.sleep(0.5)  # the stream is under way
            bigs = [pool.submit(huge, big) for _ in range(4)]
            status, body, _ = pool.submit(huge, oversized).result()
            assert status == 400 and "over the limit" in body["error"]["message"], body
            for f in bigs:
                status, body, _ = f.result()
                assert status == 400 and body["error"]["param"] == "response_format", body
                assert any(w in body["error"]["message"] for w in ("wizard", "took longer")), body
            validated = time.monotonic()
            streaming.result()
    assert ended[0] > validated, "the stream ended before the schemas were validated: nothing was measured"
    assert len(gaps) >= 50, len(gaps)
    assert max(gaps) < 1.0, sorted(gaps)[-5:]
    server.wait_idle()
