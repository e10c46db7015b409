"""/tokenize and /detokenize, vLLM's request and response shapes."""
from __future__ import annotations

import httpx
import pytest
from live_server import MODEL
from test_server_errors import assert_openai_error

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_prompt(live_server):
    tok = live_server.engine.tokenizer
    out = post(live_server, "/tokenize", {"model": MODEL, "prompt": "héllo wörld"}).json()
    ids = tok.encode("héllo wörld")
    assert ids[0] == tok.bos_token_id
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    bare = post(live_server, "/tokenize", {"prompt": "héllo wörld", "add_special_tokens": False,
                                           "return_token_strs": True}).json()
    assert bare["tokens"] == ids[1:] and bare["token_strs"] == [tok.id_to_token(t) for t in ids[1:]]
    # /detokenize inverts it; the model field is optional
    back = post(live_server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]}).json()
    assert back == {"prompt": "héllo wörld"}
    assert post(live_server, "/detokenize", {"tokens": ids}).json() == {"prompt": "<s>héllo wörld"}


def test_tokenize_messages_applies_the_chat_template(live_server):
    tok = live_server.engine.tokenizer
    out = post(live_server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert out["tokens"] == tok.encode(text, add_special_tokens=False) and out["count"] == len(out["tokens"])
    # what /v1/chat/completions counts as the prompt
    chat = httpx.post(live_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]
    no_prompt = post(live_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False),
                                             add_special_tokens=False)
    cont = post(live_server, "/tokenize", {"messages": [*CHAT, {"role": "assistant", "content": "It jumps"}],
                                           "add_generation_prompt": False, "continue_final_message": True}).json()
    assert tok.decode(cont["tokens"], skip_special_tokens=False).endswith("<|assistant|>\nIt jumps")


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, 400,
     "messages"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
])
def test_tokenize_errors(live_server, path, body, status, param):
    assert_openai_error(post(live_server, path, body), status, param)


def test_tokenizer_info(live_server):
    from standin_artifact import CHAT_TEMPLATE

    info = httpx.get(live_server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"] == CHAT_TEMPLATE
    assert info["model_max_length"] == 256 and info["vocab_size"] == live_server.engine.tokenizer.vocab_size
