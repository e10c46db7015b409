"""/v1/completions echo with prompt logprobs (what lm-eval's local-completions sends), best_of and logit_bias,
against a live server, checked against the stand-in model's dense (cache-free) forward."""
from __future__ import annotations

import math

import httpx
import pytest
import torch
from live_server import MODEL
from standin_artifact import dense_greedy, dense_logits, make_weights

PROMPT = "Paged attention stores keys and values in fixed size blocks."


@pytest.fixture(scope="module")
def weights(live_server):
    return make_weights(live_server.engine.tokenizer.vocab_size)


def post(server, body: dict) -> dict:
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, body: dict) -> list[dict]:
    import json
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_echo_prompt_logprobs_match_dense_reference(live_server, weights):
    tok = live_server.engine.tokenizer
    ids = tok.encode(PROMPT)
    out = post(live_server, {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
                             "ignore_eos": True})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    generated = dense_greedy(weights, ids, 3)
    plain = post(live_server, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["tokens"] == [tok.decode_piece(t, False) for t in ids + generated]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no context
    ref = torch.log_softmax(dense_logits(weights, ids + generated), dim=-1)
    full = ids + generated
    expected = [float(ref[j - 1, full[j]]) for j in range(1, len(full))]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(expected), atol=1e-4, rtol=0)
    for j in range(1, len(full)):  # the actual token plus the top 2 (one entry when the actual token is the top)
        top = ref[j - 1].topk(2)
        names = {tok.decode_piece(int(t), False) for t in top.indices} | {lp["tokens"][j]}
        assert set(lp["top_logprobs"][j]) == names
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3}


def test_echo_max_tokens_0_scores_the_prompt_alone(live_server):
    tok = live_server.engine.tokenizer
    ids = tok.encode(PROMPT)
    scored = post(live_server, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    with_token = post(live_server, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
                                    "temperature": 0})
    choice = scored["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"] == with_token["choices"][0]["logprobs"]["token_logprobs"][:-1]
    assert scored["usage"]["completion_tokens"] == 0
    # token-id prompts (lm-eval sends those), several at once; echo without logprobs gives the text alone
    batch = post(live_server, {"prompt": [ids, ids[:5]], "echo": True, "max_tokens": 0})
    assert [c["text"] for c in batch["choices"]] == [tok.decode(ids, False), tok.decode(ids[:5], False)]
    assert all(c["logprobs"] is None for c in batch["choices"])
    live_server.wait_idle()


def test_echo_streamed_equals_non_streamed(live_server):
    body = {"prompt": [PROMPT, "Once upon a time"], "echo": True, "logprobs": 1, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "n": 2}
    full = post(live_server, body)
    chunks = stream(live_server, body)
    for index in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        want = full["choices"][index]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert mine[0]["text"].startswith(PROMPT if index < 2 else "Once upon a time")
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        assert tokens[0] is None and want["logprobs"]["token_logprobs"][0] is None
        assert tokens[1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-5)  # batched apart
        offsets = [t for c in mine if c["logprobs"] for t in c["logprobs"]["text_offset"]]
        assert offsets == want["logprobs"]["text_offset"]
    zero = stream(live_server, {**body, "max_tokens": 0})
    assert sorted(c["choices"][0]["index"] for c in zero) == [0, 1, 2, 3]  # one chunk each: the echo, finished
    assert all(c["choices"][0]["finish_reason"] == "length" for c in zero)


def test_echo_across_prefix_cache_hit_and_chunked_prefill(live_server, make_server):
    """A prompt already in the prefix cache still gets every position's logprob, equal to a server without
    a prefix cache that prefills it in chunks of 4 tokens."""
    prompt = PROMPT + " And again: " + PROMPT
    body = {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    post(live_server, {"prompt": prompt, "max_tokens": 1})  # caches the prompt's blocks
    hits = live_server.metric("kiln:prefix_cache_hits_total")
    post(live_server, {"prompt": prompt, "max_tokens": 1})
    assert live_server.metric("kiln:prefix_cache_hits_total") > hits  # the cache does hold this prompt
    cached = post(live_server, body)["choices"][0]["logprobs"]
    plain = make_server({"num_kv_blocks": 256, "prefix_cache": None, "chunked_prefill": 4})
    uncached = post(plain, body)["choices"][0]["logprobs"]
    assert cached["tokens"] == uncached["tokens"]
    assert cached["token_logprobs"][0] is None and uncached["token_logprobs"][0] is None
    # the same fp32 computation summed in another order (chunks of 4, cached blocks): kiln's fp32 logprob
    # tolerance (1e-4, as against HF); 1e-5 failed by 1.3e-5 on a logprob of -10.7 with AVX-512 GEMMs
    torch.testing.assert_close(torch.tensor(cached["token_logprobs"][1:]),
                               torch.tensor(uncached["token_logprobs"][1:]), atol=1e-4, rtol=0)
    assert [set(t) for t in cached["top_logprobs"][1:]] == [set(t) for t in uncached["top_logprobs"][1:]]
    live_server.wait_idle()
    plain.wait_idle()


def test_best_of_returns_the_highest_cumulative_logprob(live_server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    every = post(live_server, {**body, "n": 4, "logprobs": 0})["choices"]
    totals = [math.fsum(c["logprobs"]["token_logprobs"]) for c in every]
    ranked = sorted(range(4), key=lambda i: totals[i], reverse=True)
    best = post(live_server, {**body, "best_of": 4})
    assert [c["text"] for c in best["choices"]] == [every[ranked[0]]["text"]]
    assert best["choices"][0]["logprobs"] is None and best["choices"][0]["index"] == 0
    assert best["usage"]["completion_tokens"] == 24  # all four were generated
    two = post(live_server, {**body, "n": 2, "best_of": 4, "logprobs": 1})
    assert [c["text"] for c in two["choices"]] == [every[i]["text"] for i in ranked[:2]]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    live_server.wait_idle()


def test_logit_bias(live_server, weights):
    tok = live_server.engine.tokenizer
    ids = tok.encode(PROMPT)
    greedy = dense_greedy(weights, ids, 4)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    forced = greedy[0] + 7 if greedy[0] + 7 < tok.vocab_size else 5
    out = post(live_server, {**body, "logit_bias": {str(forced): 100}})["choices"][0]
    assert out["logprobs"]["tokens"] == [tok.decode_piece(forced, False)] * 4
    banned = post(live_server, {**body, "logit_bias": {str(greedy[0]): -100}})["choices"][0]
    ref = dense_logits(weights, ids)[-1]
    ref[greedy[0]] -= 100
    assert banned["logprobs"]["tokens"][0] == tok.decode_piece(int(ref.argmax()), False)
    # a request without a bias in the same batch is untouched
    plain = post(live_server, {**body, "prompt": [ids, ids]})
    assert [c["logprobs"]["tokens"] for c in plain["choices"]] == [[tok.decode_piece(t, False) for t in greedy]] * 2
    chat = httpx.post(live_server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "logit_bias": {str(forced): 100}}).json()
    assert chat["choices"][0]["message"]["content"] == tok.decode([forced] * 3)
