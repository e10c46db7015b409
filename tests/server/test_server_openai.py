"""The official `openai` client against a live server: chat and completions, streamed and not."""
from __future__ import annotations

import httpx
import pytest
from live_server import MODEL

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The quick brown fox"}]


def test_models_and_health(live_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_completion_usage_and_token_prompts(client, live_server):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_ids = live_server.engine.tokenizer.encode("The quick brown fox")
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    # The same prompt as token ids, alone and in a batch of prompts: same greedy text.
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=7, **GREEDY)
    assert by_ids.choices[0].text == choice.text
    batch = client.completions.create(model=MODEL, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=7, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == choice.text
    texts = client.completions.create(model=MODEL, prompt=["The quick brown fox", "Once upon"], max_tokens=7,
                                      **GREEDY)
    assert texts.choices[0].text == choice.text and texts.usage.completion_tokens == 14


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_stream_and_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, **GREEDY)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(client):
    out = client.completions.create(model=MODEL, prompt="The quick", n=2, max_tokens=6, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, stream=True,
                                               temperature=1.0, seed=3))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_seed_reproducible(client):
    def sample(seed):
        out = client.completions.create(model=MODEL, prompt="Paged attention", n=2, max_tokens=10,
                                        temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    assert first[0] != first[1]  # completion i draws from seed + i


def test_stop_strings_streamed_and_not(client):
    base = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, **GREEDY)
    text = base.choices[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    expected = text[:text.find(stop)]
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=[stop, "\x00zz"],
                                    **GREEDY)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=stop,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected  # the stop string never leaks into the stream
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the chosen token plus the top 3 (fewer when tokens decode alike, e.g. partial UTF-8 bytes)
        assert logprob <= 0 and top[token] == logprob and 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=5, logprobs=3, stream=True, **GREEDY)
        if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2,
                                         **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_sampling_extras_accepted(client):
    out = client.completions.create(
        model=MODEL, prompt="héllo wörld", max_tokens=8, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=7, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True,
                    "stop_token_ids": [2]})
    assert out.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, response_format={"type": "text"},
                                          messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat.choices[0].message.content is not None
