"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the live server on the embedded
model, with the official `anthropic` client: whole and streamed answers that agree (greedy), the event sequence,
token counts that equal what the chat path counts for the same conversation, a forced tool call whose input fits
the tool's schema and its tool_result round trip, thinking blocks on a model whose template opens one, the API
key as `x-api-key` or `Authorization: Bearer`, and errors in Anthropic's shape."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from schemas import WEATHER
from test_serve_structured import THINKING_TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import LiveServer  # noqa: E402

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "embedded"
ENGINE = {"grammar_max_whitespace": 2, "max_num_seqs": 16}
TOOLS = [{"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                "required": ["zone"]}}]
GREEDY = {"temperature": 0}  # the client (2.x) sends sampling fields only in extra_body
HELLO = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def server(embedded_artifact):
    s = LiveServer(embedded_artifact, ENGINE, tool_parser="hermes", served_model_name=MODEL)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _chat_prompt_tokens(server, messages: list[dict], **extra) -> int:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_whole_and_streamed_greedy_answers_agree(client, server):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, system="You tell short stories.", messages=HELLO)
    whole = client.messages.create(**kwargs)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert 0 < whole.usage.output_tokens <= 24
    assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == 24)
    # the prompt is the chat path's: a system message, then the user's
    chat = [{"role": "system", "content": "You tell short stories."}, *HELLO]
    assert whole.usage.input_tokens == _chat_prompt_tokens(server, chat)
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text
    assert final.content[0].text == block.text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "messages": HELLO, "stream": True}
    raw = httpx.post(server.url + "/v1/messages", json=body, timeout=60).text
    events = []
    for record in raw.strip().split("\n\n"):
        kind, data = record.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), record
        events.append(kind.removeprefix("event: "))
        assert json.loads(data.removeprefix("data: "))["type"] == events[-1]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}
    server.wait_idle()


def test_stop_sequences_end_with_stop_sequence(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=HELLO)
    text = whole.content[0].text
    word = next(w for w in text.split(" ")[1:] if w.strip())  # a word the greedy answer writes after its first
    r = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=HELLO, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == text[:text.index(word)]


def test_count_tokens_is_the_rendered_prompt(client, server):
    system = [{"type": "text", "text": "Be brief."}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
    n = client.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
    assert n == _chat_prompt_tokens(server, chat)
    with_tools = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS).input_tokens
    functions = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                   **({"description": t["description"]} if "description" in t
                                                      else {})}} for t in TOOLS]
    assert with_tools == _chat_prompt_tokens(server, chat[1:], tools=functions)  # (this template shows no tools)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_fits_the_schema_and_round_trips(client, server, choice):
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=question, tools=TOOLS, tool_choice=choice)
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use", whole
    [call] = [b for b in whole.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert call.name == "get_weather"
    jsonschema.validate(call.input, schemas[call.name])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"
    # the round trip: the call as the assistant's turn, its result as the user's
    turns = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=turns, tools=TOOLS)
    assert answer.role == "assistant" and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    functions = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                   **({"description": t["description"]} if "description" in t
                                                      else {})}} for t in TOOLS]
    text = "".join(b.text for b in whole.content if b.type == "text")
    chat = [*question, {"role": "assistant", "content": text, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    assert answer.usage.input_tokens == _chat_prompt_tokens(server, chat, tools=functions)
    server.wait_idle()


def test_errors_are_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": MODEL, "messages": HELLO}, cast_to=anthropic.types.Message)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", messages=HELLO, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}])
    assert "image" in e.value.body["error"]["message"]
    cases = [({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
             ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking.budget_tokens"),
             ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
             ({"top_k": "many"}, "top_k")]
    for extra, words in cases:
        r = httpx.post(server.url + "/v1/messages", timeout=30,
                       json={"model": MODEL, "max_tokens": 4, "messages": HELLO, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert words in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/messages", timeout=30)  # a method the route has not
    assert r.status_code == 405 and r.json()["type"] == "error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_the_api_key_as_x_api_key_or_bearer(embedded_artifact):
    s = LiveServer(embedded_artifact, ENGINE, served_model_name=MODEL, api_key="sekret")
    try:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0, timeout=60)  # x-api-key
        assert ok.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=s.url, auth_token="sekret", max_retries=0, timeout=60)
        assert bearer.messages.create(model=MODEL, messages=HELLO, max_tokens=2).usage.output_tokens > 0
        wrong = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": HELLO}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # x-api-key is Anthropic's header: the OpenAI routes still want Authorization
        r = httpx.post(s.url + "/v1/chat/completions", headers={"x-api-key": "sekret"}, timeout=30,
                       json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
        assert r.status_code == 401
    finally:
        s.stop()


@pytest.fixture(scope="module")
def thinking_server(embedded_artifact, tmp_path_factory):
    art = tmp_path_factory.mktemp("thinking") / MODEL
    shutil.copytree(embedded_artifact, art)
    config_path = art / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    s = LiveServer(art, ENGINE, served_model_name=MODEL)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("budget", [8, 20])
def test_thinking_blocks_are_the_chat_paths_reasoning_whole_and_streamed(thinking_server, budget):
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0, timeout=120)
    prompt = [{"role": "user", "content": "Tell me a fortune."}]
    thought_seen = 0
    for seed in range(3):
        sampling = {"temperature": 1.0, "seed": seed}
        kwargs = dict(model=MODEL, max_tokens=budget + 30, messages=prompt, extra_body=sampling,
                      thinking={"type": "enabled", "budget_tokens": budget})
        whole = client.messages.create(**kwargs)
        chat = httpx.post(thinking_server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": prompt, "max_tokens": budget + 30, "max_thinking_tokens": budget,
            **sampling}).json()
        message = chat["choices"][0]["message"]
        expected = ([{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}]
                    if message["reasoning_content"] else []) + \
            ([{"type": "text", "text": message["content"], "citations": None}] if message["content"] else [])
        assert [b.model_dump() for b in whole.content] == expected
        thinking = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert whole.usage.output_tokens_details.thinking_tokens == thinking and 0 < thinking <= budget
        assert whole.usage.output_tokens == chat["usage"]["completion_tokens"]
        thought_seen += whole.content[0].type == "thinking"
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        assert final.usage.output_tokens_details.thinking_tokens == thinking
    assert thought_seen >= 2
