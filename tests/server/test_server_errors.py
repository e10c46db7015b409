"""Bad input answers a 4xx with OpenAI's error object, and the server keeps serving; auth, overload, failures."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from live_server import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD_COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def completion(**fields):
    return json.dumps({**GOOD_COMPLETION, **fields}).encode()


def chat(**fields):
    return json.dumps({**GOOD_CHAT, **fields}).encode()


def without(body: dict, key: str) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != key}).encode()


BAD_REQUESTS = [  # (id, path, body, status, param)
    ("malformed-json", COMPLETIONS, b'{"model": "standin", "prompt": ', 400, None),
    ("invalid-utf8", COMPLETIONS, b'{"model": "standin", "prompt": "\xff\xfe"}', 400, None),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("nan", COMPLETIONS, b'{"model": "standin", "prompt": "x", "temperature": NaN}', 400, None),
    ("inf", COMPLETIONS, b'{"model": "standin", "prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("unknown-field", COMPLETIONS, completion(max_token=3), 400, "max_token"),
    ("missing-model", COMPLETIONS, without(GOOD_COMPLETION, "model"), 400, "model"),
    ("missing-prompt", COMPLETIONS, without(GOOD_COMPLETION, "prompt"), 400, "prompt"),
    ("missing-messages", CHAT, without(GOOD_CHAT, "messages"), 400, "messages"),
    ("max-tokens-string", COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", COMPLETIONS, completion(max_tokens=5.5), 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", COMPLETIONS, completion(max_tokens=10**12), 400, "max_tokens"),
    ("max-completion-tokens-huge", CHAT, chat(max_completion_tokens=10**40), 400, "max_tokens"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-negative", COMPLETIONS, completion(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top-k-bad", COMPLETIONS, completion(top_k=-2), 400, "top_k"),
    ("top-k-beyond-int64", COMPLETIONS, completion(top_k=2**63, temperature=1.0), 400, "top_k"),
    ("temperature-huge", CHAT, chat(temperature=1e39), 400, "temperature"),
    ("repetition-penalty-tiny", COMPLETIONS, completion(repetition_penalty=1e-300), 400, "repetition_penalty"),
    ("repetition-penalty-huge", CHAT, chat(repetition_penalty=1e300), 400, "repetition_penalty"),
    ("seed-below-int64", CHAT, chat(seed=-2**63 - 1), 400, "seed"),
    ("max-tokens-beyond-int64", COMPLETIONS, completion(max_tokens=2**64), 400, "max_tokens"),
    ("stop-token-beyond-int64", COMPLETIONS, completion(stop_token_ids=[2**63]), 400, "stop_token_ids"),
    ("stop-token-beyond-vocab", CHAT, chat(stop_token_ids=[5, 10**6]), 400, "stop_token_ids"),
    ("stop-too-many", COMPLETIONS, completion(stop=[f"s{i}" for i in range(33)]), 400, "stop"),
    ("stop-too-long", CHAT, chat(stop=["x" * 513]), 400, "stop"),
    ("prompt-id-beyond-int64", COMPLETIONS, completion(prompt=[1, 2**70]), 400, "prompt"),
    ("prompts-more-than-the-queue", COMPLETIONS, completion(prompt=[[1, 2]] * 1025), 400, "prompt"),
    ("prompts-times-n-more-than-the-queue", COMPLETIONS, completion(prompt=[[1, 2]] * 9, n=128), 400, "n"),
    ("min-p-bad", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    ("presence-penalty-bad", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-bad", COMPLETIONS, completion(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("repetition-penalty-bad", COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("n-zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("n-huge", CHAT, chat(n=100000), 400, "n"),
    ("n-float", CHAT, chat(n=1.0), 400, "n"),
    ("stream-not-bool", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    ("seed-huge", COMPLETIONS, completion(seed=2**70), 400, "seed"),
    ("seed-string", COMPLETIONS, completion(seed="1"), 400, "seed"),
    ("stop-empty", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("stop-int", CHAT, chat(stop=5), 400, "stop"),
    ("stop-mixed", COMPLETIONS, completion(stop=["a", 3]), 400, "stop"),
    ("logprobs-too-many", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
    ("chat-logprobs-int", CHAT, chat(logprobs=3), 400, "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("prompt-int", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("prompt-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt-empty-ids", COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    ("prompt-negative-id", COMPLETIONS, completion(prompt=[1, -1]), 400, "prompt"),
    ("prompt-id-out-of-vocab", COMPLETIONS, completion(prompt=[[1, 2], [999999]]), 400, "prompt"),
    ("prompt-bool-ids", COMPLETIONS, completion(prompt=[True, False]), 400, "prompt"),
    ("prompt-over-context", COMPLETIONS, completion(prompt="fox " * 400), 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", COMPLETIONS, completion(prompt=[5] * 200, max_tokens=100), 400,
     "max_tokens"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("message-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("message-content-int", CHAT, chat(messages=[{"role": "user", "content": 3}]), 400, "messages.0.content"),
    ("message-image", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400, "messages.0.content.0"),
    ("template-rejects", CHAT, chat(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]),
     400, "messages"),
    ("chat-over-context", CHAT, chat(messages=[{"role": "user", "content": "fox " * 400}]), 400, "messages"),
    ("unknown-model", COMPLETIONS, completion(model="gpt-4"), 404, "model"),
    ("unknown-model-chat", CHAT, chat(model="gpt-4"), 404, "model"),
    ("json-schema-uncompilable", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wizard"}}}), 400, "response_format"),
    ("json-schema", COMPLETIONS, completion(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format"),
    ("response-format-bogus", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("suffix", COMPLETIONS, completion(suffix="!"), 400, "suffix"),
    ("max-tokens-0-without-echo", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("echo-not-bool", COMPLETIONS, completion(echo="yes"), 400, "echo"),
    ("best-of-below-n", COMPLETIONS, completion(n=3, best_of=2), 400, "best_of"),
    ("best-of-too-many", COMPLETIONS, completion(best_of=1000), 400, "best_of"),
    ("best-of-streamed", COMPLETIONS, completion(best_of=3, stream=True), 400, "best_of"),
    ("logit-bias-over-100", CHAT, chat(logit_bias={"5": 100.5}), 400, "logit_bias"),
    ("logit-bias-below-100", COMPLETIONS, completion(logit_bias={"5": -101}), 400, "logit_bias"),
    ("logit-bias-bad-key", CHAT, chat(logit_bias={"fox": 1}), 400, "logit_bias"),
    ("logit-bias-negative-key", CHAT, chat(logit_bias={"-5": 1}), 400, "logit_bias"),
    ("logit-bias-past-vocab", COMPLETIONS, completion(logit_bias={"100000": 1}), 400, "logit_bias"),
    ("logit-bias-not-number", COMPLETIONS, completion(logit_bias={"5": "x"}), 400, "logit_bias.5"),
    # the stand-in's chat template writes no tool calls, and the server was given no --tool-parser
    ("tools-without-format", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("bad-field-with-stream", COMPLETIONS, completion(stream=True, max_tokens=-3), 400, "max_tokens"),
    ("template-kwargs-clash", CHAT, chat(chat_template_kwargs={"messages": []}), 400, "messages"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_then_good_request(live_server, path, body, status, param):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert_openai_error(response, status, param)
        good = http.post(CHAT if path == CHAT else COMPLETIONS, json=GOOD_CHAT if path == CHAT else GOOD_COMPLETION)
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_unknown_route_and_method(live_server):
    error = assert_openai_error(httpx.get(live_server.url + "/v1/nothing"), 404)
    assert error["code"] == "unknown_url"
    assert_openai_error(httpx.get(live_server.url + COMPLETIONS), 405)
    assert_openai_error(httpx.get(live_server.url + "/v1/models/gpt-4"), 404, "model")
    live_server.wait_idle()


def test_api_key(make_server):
    server = make_server(api_key="sekret")
    url = server.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_openai_error(httpx.post(url + COMPLETIONS, json=body), 401)
    error = assert_openai_error(httpx.post(url + COMPLETIONS, json=body, headers={"Authorization": "Bearer nope"}),
                                401)
    assert error["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": "sekret"}), 401)
    ok = httpx.post(url + COMPLETIONS, json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # a load balancer's probe needs no key
    assert_openai_error(httpx.get(url + "/metrics"), 401)  # the metrics name the model and its load
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
    public = make_server(api_key="sekret", metrics_public=True)
    assert httpx.get(public.url + "/metrics").status_code == 200
    assert_openai_error(httpx.get(public.url + "/v1/models"), 401)

    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_overload_answers_503_then_recovers(make_server):
    server = make_server({"max_num_seqs": 1}, max_waiting=2, served_model_name="tiny-queue")
    body = {"model": "tiny-queue", "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            responses = await asyncio.gather(*(http.post(COMPLETIONS, json=body) for _ in range(12)))
        for r in responses:
            if r.status_code == 503:
                assert assert_openai_error(r, 503)["code"] == "overloaded"
        return [r.status_code for r in responses]

    with server.slow_steps(0.02):
        codes = asyncio.run(burst())
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    assert httpx.post(server.url + COMPLETIONS, json=body).status_code == 200
    server.wait_idle()


def test_engine_failure_fails_requests_not_the_server(make_server):
    server = make_server(served_model_name="flaky")
    body = {"model": "flaky", "prompt": "The quick brown fox", "max_tokens": 5}

    def break_next_step(engine):
        def boom(batch):
            del engine.runner.execute  # fail once, then the class's execute is back
            raise RuntimeError("injected kernel failure")
        engine.runner.execute = boom

    server.in_engine(break_next_step)
    error = assert_openai_error(httpx.post(server.url + COMPLETIONS, json=body), 500)
    assert error["type"] == "server_error" and "injected kernel failure" in error["message"]
    server.wait_idle()

    server.in_engine(break_next_step)
    with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert "injected kernel failure" in json.loads(events[-2][6:])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    server.wait_idle()

    ok = httpx.post(server.url + COMPLETIONS, json=body)
    assert ok.status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()
