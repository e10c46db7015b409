"""The OpenAI server over a LoRA artifact: `model` selects the adapter, /v1/models lists them, and adapters are
loaded and unloaded at run time through POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from lora_testlib import ATTENTION, ATTENTION_MLP

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from live_server import LiveServer  # noqa: E402

PROMPT = [5, 17, 33, 101, 7, 250, 9, 11]


@pytest.fixture(scope="module")
def served(adapter, compile_lora):
    art = compile_lora("max_loras = 2; max_rank = 8", {"a": adapter(ATTENTION, seed=21)})
    server = LiveServer(art, {"num_kv_blocks": 64})
    try:
        yield art, server
    finally:
        server.stop()


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                     "temperature": 0}, timeout=30)


def _alone(art, lora) -> str:
    params = kiln.SamplingParams(max_tokens=6, temperature=0.0)
    return kiln.LLM(str(art)).generate([PROMPT], params, lora=lora)[0].outputs[0].text


def test_model_field_selects_the_adapter(served):
    art, server = served
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    base_name = models[0]["id"]
    assert [m["id"] for m in models] == [base_name, "a"] and models[1]["parent"] == base_name
    base, lora = _complete(server.url, base_name), _complete(server.url, "a")
    assert base.status_code == lora.status_code == 200
    assert base.json()["choices"][0]["text"] != lora.json()["choices"][0]["text"]
    assert lora.json()["choices"][0]["text"] == _alone(art, "a")
    assert base.json()["choices"][0]["text"] == _alone(art, None)
    missing = _complete(server.url, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(served, adapter, tmp_path):
    art, server = served
    path = adapter(ATTENTION_MLP, seed=22)
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(path)}, timeout=30)
    assert r.status_code == 200, r.text
    assert "b" in [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
    assert httpx.get(f"{server.url}/v1/models/b", timeout=10).json()["parent"] == server.server_state.model_name
    out = _complete(server.url, "b")
    assert out.status_code == 200
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(path)},
                       timeout=30)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)},
                     timeout=30)
    assert bad.status_code == 400 and "not a PEFT adapter" in bad.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c"}, timeout=30).status_code == 400
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=30)
    assert r.status_code == 200, r.text
    assert _complete(server.url, "b").status_code == 404
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=30)
    assert gone.status_code == 404
    assert _complete(server.url, "a").status_code == 200  # the others are unaffected
