"""The OpenAI server over a LoRA artifact: `model` selects the adapter, /v1/models lists them, and adapters are
loaded and unloaded at run time through POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from kiln.runtime.worker import lora as lora_module
from lora_testlib import ATTENTION, ATTENTION_MLP

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from live_server import LiveServer  # noqa: E402

PROMPT = [5, 17, 33, 101, 7, 250, 9, 11]


@pytest.fixture(scope="module")
def served(adapter, compile_lora):
    """The server with run-time loading on, confined to the directory the adapters fixture writes into."""
    path = adapter(ATTENTION, seed=21)
    art = compile_lora("max_loras = 2; max_rank = 8", {"a": path})
    server = LiveServer(art, {"num_kv_blocks": 64, "lora_roots": [str(path.parent)]})
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
    empty = path.parent / "empty"
    empty.mkdir(exist_ok=True)
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(empty)},
                     timeout=30)
    assert bad.status_code == 400 and "not a PEFT adapter" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c"}, timeout=30).status_code == 400
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=30)
    assert r.status_code == 200, r.text
    assert _complete(server.url, "b").status_code == 404
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=30)
    assert gone.status_code == 404
    assert _complete(server.url, "a").status_code == 200  # the others are unaffected


def _load(url: str, name: str, path) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def test_models_show_no_server_paths(served):
    _, server = served
    text = httpx.get(f"{server.url}/v1/models", timeout=10).text
    card = next(m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"] if m["id"] == "a")
    assert card["root"] == "a"
    assert str(Path(tempfile.gettempdir())) not in text and "adapter-" not in text


def test_loads_outside_the_roots_are_refused(served, adapter, tmp_path):
    """A path outside --lora-roots, a symlink inside them leading out, and an adapter whose files link out:
    403, nothing loaded, and the refusal does not show where the links lead."""
    _, server = served
    root = adapter(ATTENTION, seed=21).parent
    outside = tmp_path / "outside"
    shutil.copytree(adapter(ATTENTION_MLP, seed=22), outside)
    (root / "escape").unlink(missing_ok=True)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    linked = root / "linked-files"
    linked.mkdir(exist_ok=True)
    for f in outside.iterdir():
        (linked / f.name).unlink(missing_ok=True)
        (linked / f.name).symlink_to(f)
    for path in (outside, root / "escape", linked, root / ".." / outside.name, "../" * 20 + "etc"):
        r = _load(server.url, "x", path)
        assert r.status_code == 403, (path, r.text)
        assert "--lora-roots" in r.json()["error"]["message"] and r.json()["error"]["param"] == "lora_path"
        if path != outside:  # the path as given, never where its links lead
            assert str(outside) not in r.json()["error"]["message"]
    assert "x" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]


def test_fifo_and_dev_zero_adapters_are_refused_at_once(served, adapter):
    """A FIFO adapter_config.json would block the core's loop for ever, a /dev/zero weights file fill its memory;
    both are refused within seconds and the completions beside them are served."""
    _, server = served
    root = adapter(ATTENTION, seed=21).parent
    fifo_dir, zero_dir = root / "fifo", root / "zero"
    for d in (fifo_dir, zero_dir):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(adapter(ATTENTION_MLP, seed=22), fifo_dir)
    (fifo_dir / "adapter_config.json").unlink()
    os.mkfifo(fifo_dir / "adapter_config.json")
    shutil.copytree(adapter(ATTENTION_MLP, seed=22), zero_dir)
    (zero_dir / "adapter_model.safetensors").unlink()
    (zero_dir / "adapter_model.safetensors").symlink_to("/dev/zero")
    before = time.monotonic()
    base = server.server_state.model_name
    with ThreadPoolExecutor(3) as pool:
        fifo = pool.submit(_load, server.url, "fifo", fifo_dir)
        zero = pool.submit(_load, server.url, "zero", zero_dir)
        done = pool.submit(_complete, server.url, base)
        fifo, zero, done = fifo.result(), zero.result(), done.result()
    assert time.monotonic() - before < 10
    assert fifo.status_code == 400 and "not a regular file" in fifo.json()["error"]["message"], fifo.text
    assert fifo.json()["error"]["param"] == "lora_path"
    assert zero.status_code == 403 and "links outside" in zero.json()["error"]["message"], zero.text
    assert done.status_code == 200 and _complete(server.url, "a").status_code == 200


def _slow_weight_reads(engine, seconds):
    """Every adapter_model.safetensors read in the core takes `seconds` more (a large adapter on a slow disk)."""
    original = lora_module.read_bounded

    def slow(file, max_bytes):
        if file.name == "adapter_model.safetensors":
            time.sleep(seconds)
        return original(file, max_bytes)

    slow.original = original
    lora_module.read_bounded = slow


def _fast_reads(engine):
    lora_module.read_bounded = getattr(lora_module.read_bounded, "original", lora_module.read_bounded)


def _token_times(url: str, model: str, times: list[float]) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())


def test_a_slow_adapter_read_does_not_stall_the_streams(served, adapter):
    """The adapter's files are read off the core's step loop: while a load whose weights take 3 s to read is in
    progress, a concurrent stream's tokens keep coming (before: one gap of the whole read)."""
    _, server = served
    path = adapter(ATTENTION_MLP, seed=23)
    base = server.server_state.model_name
    times: list[float] = []
    server.in_engine(_slow_weight_reads, 3.0)
    try:
        with server.slow_steps(0.06), ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_token_times, server.url, base, times)
            deadline = time.monotonic() + 30
            while len(times) < 3:
                assert time.monotonic() < deadline and not stream.done(), "the stream did not start"
                time.sleep(0.01)
            start = time.monotonic()
            r = _load(server.url, "slow", path)
            end = time.monotonic()
            stream.result()
    finally:
        server.in_engine(_fast_reads)
    assert r.status_code == 200, r.text
    assert end - start >= 3.0  # the read did take its time
    during = [t for t in times if start <= t <= end]
    assert len(during) >= 10, f"{len(during)} tokens streamed during a {end - start:.1f} s load"
    gaps = [b - a for a, b in zip([start, *during], [*during, end])]
    assert max(gaps) < 1.0, f"the stream stalled {max(gaps):.2f} s during the load"
    assert _complete(server.url, "slow").status_code == 200  # installed: served from the next request on
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "slow"}, timeout=30).status_code == 200


def test_run_time_loading_is_off_by_default(adapter, compile_lora):
    path = adapter(ATTENTION, seed=21)
    art = compile_lora("max_loras = 2; max_rank = 8", {"a": path})
    server = LiveServer(art, {"num_kv_blocks": 64})
    try:
        r = _load(server.url, "b", adapter(ATTENTION_MLP, seed=22))
        assert r.status_code == 403 and "--enable-lora-loading" in r.json()["error"]["message"], r.text
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]][1:] == ["a"]
        gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30)
        assert gone.status_code == 403 and "--enable-lora-loading" in gone.json()["error"]["message"], gone.text
        assert _complete(server.url, "a").status_code == 200  # compiled-in adapters are served as before
    finally:
        server.stop()
