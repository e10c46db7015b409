"""/v1/responses with the official `openai` client: create (text and chat-style input, instructions, limits,
sampling), streamed as the Responses event sequence and not, previous_response_id turns, store, retrieve and
delete; and its errors."""
from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL
from test_server_errors import assert_openai_error

GREEDY = {"temperature": 0.0, "extra_body": {}}


def chat_text(client, messages, max_tokens):
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_create_equals_the_chat_completion_it_is(client):
    out = client.responses.create(model=MODEL, input="The quick brown fox", instructions="Be brief.",
                                  max_output_tokens=6, temperature=0.0)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "The quick brown fox"}], 6)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == text
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage.input_tokens == prompt_tokens and out.usage.output_tokens <= 6
    assert out.instructions == "Be brief." and out.max_output_tokens == 6 and out.temperature == 0.0
    if out.usage.output_tokens == 6:
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed"
    # chat-style input items (content parts too) give the same conversation
    items = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0.0, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The quick brown fox"}]}])
    assert items.output_text == text


def test_streamed_event_sequence(client):
    kwargs = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 8, "temperature": 0.0}
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    final = "response.incomplete" if full.status == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert deltas >= 1 and [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text
    assert events[-1].response.output_text == text and events[-1].response.status == full.status
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    # the stream's response was stored too
    assert client.responses.retrieve(events[-1].response.id).output_text == text


def test_previous_response_id_round_trip(client):
    first = client.responses.create(model=MODEL, input="The quick brown fox", instructions="Be brief.",
                                    max_output_tokens=5, temperature=0.0)
    second = client.responses.create(model=MODEL, input="Once upon a time", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0.0)
    assert second.previous_response_id == first.id
    # the instructions are not carried over; the previous turns are
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": "The quick brown fox"},
                                             {"role": "assistant", "content": first.output_text},
                                             {"role": "user", "content": "Once upon a time"}], 5)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    third = client.responses.create(model=MODEL, input="héllo", previous_response_id=second.id,
                                    max_output_tokens=3, temperature=0.0)
    assert third.usage.input_tokens > second.usage.input_tokens
    streamed = list(client.responses.create(model=MODEL, input="Once upon a time", previous_response_id=first.id,
                                            max_output_tokens=5, temperature=0.0, stream=True))
    assert streamed[-1].response.output_text == second.output_text
    # the stateless way: the previous output items sent back as input
    manual = client.responses.create(model=MODEL, max_output_tokens=5, temperature=0.0, input=[
        {"role": "user", "content": "The quick brown fox"}, *first.output,
        {"role": "user", "content": "Once upon a time"}])
    assert manual.output_text == second.output_text


def test_store_retrieve_delete(client, live_server):
    kept = client.responses.create(model=MODEL, input="Paged attention", max_output_tokens=3, temperature=0.0)
    got = client.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text and got.status == kept.status
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=kept.id, max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="Paged attention", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_is_bounded():
    from kiln.runtime.api.responses import ResponseStore

    store = ResponseStore(max_responses=3, max_chars=100)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # recently used: kept over r3
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 75}])
    assert store.get("r2") is not None and store.get("r3") is None and store.num_chars <= 100
    assert store.delete("big") and not store.delete("big")


def test_sampling_fields_reach_the_engine(client):
    kwargs = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 12, "temperature": 1.0}
    hot = {client.responses.create(**kwargs).output_text for _ in range(3)}
    assert len(hot) > 1  # sampled
    narrow = {client.responses.create(**kwargs, top_p=1e-6).output_text for _ in range(2)}
    assert len(narrow) == 1 and narrow == {client.responses.create(**{**kwargs, "temperature": 0.0}).output_text}


def test_logprobs(client):
    out = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=4, temperature=0.0,
                                  top_logprobs=2, include=["message.output_text.logprobs"])
    logprobs = out.output[0].content[0].logprobs
    assert len(logprobs) == out.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert "".join(t.token for t in logprobs).startswith(out.output_text[:1])


def post(server, body):
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x", "model": "gpt-4"}, 404, "model"),
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": 3}, 400, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, 400, "input.0.bogus"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 500}, 400, "temperature"),
    ({"input": "x", "top_p": 0}, 400, "top_p"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include.0"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"input": "fox " * 400}, 400, "input"),
    ({"input": "x", "max_output_tokens": 300}, 400, "max_output_tokens"),
])
def test_errors(live_server, body, status, param):
    assert_openai_error(post(live_server, body), status, param)
    assert post(live_server, {"input": "x", "max_output_tokens": 2}).status_code == 200


def test_text_format_goes_where_response_format_goes(live_server):
    """text.format json_schema becomes chat's response_format and is answered as chat answers it (its output
    validating against the schema: tests/structured/test_serve_structured.py)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = post(live_server, {"input": "x", "text": {"format": {"type": "json_schema", "name": "obj",
                                                                     "schema": schema, "strict": True}}})
    chat = httpx.post(live_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "obj", "schema": schema}}})
    assert response.status_code == chat.status_code
    if chat.status_code != 200:
        assert response.json()["error"]["param"] == "text.format"
    assert post(live_server, {"input": "x", "text": {"format": {"type": "text"}}, "max_output_tokens": 2}) \
        .json()["text"] == {"format": {"type": "text"}}
