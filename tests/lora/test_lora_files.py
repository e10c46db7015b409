"""The files of a LoRA adapter: regular files of bounded size only (a FIFO, a device, a huge file are refused before
anything is read), confined to --lora-roots for run-time loads; and a router over replicas that reports any
replica's refusal of a load instead of the first replica's success."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from kiln.runtime.disagg.router import ReplicaRouter
from kiln.runtime.worker.lora import (
    LoRAError,
    LoRATarget,
    max_adapter_bytes,
    read_adapter,
    read_adapter_config,
)
from kiln.runtime.worker.lora_files import AdapterFileError, confine, read_bounded, resolve_roots

TARGET = LoRATarget("decoder.wq", "decoder", 2, 0, 16, ("model.layers.{i}.self_attn.q_proj",), (16,))


def _within(seconds: float, fn, *args):
    """fn(*args) run in a thread that must finish within `seconds` (a blocked read would hang the test)."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} still running after {seconds} s"
    return out, time.monotonic() - start


def _adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ad"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    return d


def test_a_fifo_config_is_refused_without_blocking(tmp_path):
    d = tmp_path / "ad"
    d.mkdir()
    os.mkfifo(d / "adapter_config.json")
    out, took = _within(5, read_adapter_config, d)
    assert isinstance(out.get("error"), LoRAError) and "not a regular file" in str(out["error"])
    assert took < 2


def test_dev_zero_weights_are_refused_before_any_read(tmp_path):
    d = _adapter_dir(tmp_path)
    (d / "adapter_model.safetensors").symlink_to("/dev/zero")
    out, took = _within(5, read_adapter, d, [TARGET], 4, None)
    assert isinstance(out.get("error"), LoRAError) and "not a regular file" in str(out["error"])
    assert took < 2


def test_a_file_above_the_bound_is_refused_unread(tmp_path):
    d = _adapter_dir(tmp_path)
    bound = max_adapter_bytes([TARGET], 4)
    with open(d / "adapter_model.safetensors", "wb") as f:
        f.truncate(bound + 1)  # sparse: reading it would take the bound's worth of memory
    out, _ = _within(5, read_adapter, d, [TARGET], 4, None)
    assert isinstance(out.get("error"), LoRAError) and f"above the {bound}" in str(out["error"])
    with pytest.raises(AdapterFileError, match="above the 10"):
        read_bounded(d / "adapter_config.json", 10)
    assert read_bounded(d / "adapter_config.json", 1000).startswith(b"{")


def test_confine_resolves_links_and_refuses_escapes(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "ok" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    roots = resolve_roots([root])
    (root / "good").mkdir()
    assert confine(root / "good", roots) == (root / "good").resolve()
    assert confine("good", roots) == (root / "good").resolve()  # relative: to the first root
    for path in (outside, root / "out", root / ".." / "outside", "../outside"):
        with pytest.raises(AdapterFileError, match="outside the server's --lora-roots"):
            confine(path, roots)
    with pytest.raises(AdapterFileError, match="links outside"):
        confine(root / "ok", roots)
    with pytest.raises(AdapterFileError, match="not a directory"):
        resolve_roots([tmp_path / "missing"])


class _Replica:
    """A replica engine as the router's call_utility sees it: answers a load with `answer`, records calls."""

    def __init__(self, answer) -> None:
        from kiln.runtime.api.async_engine import RequestObserver
        from kiln.runtime.ipc.protocol import RequestLimits

        self.info = type("Info", (), {"limits": RequestLimits(1000, 512, 4, 64)})()
        self.tokenizer, self.max_waiting, self.observer, self.is_running = None, 1024, RequestObserver(), True
        self.answer, self.calls = answer, []

    async def call_utility(self, method, *args, timeout=30.0):
        self.calls.append((method, *args))
        if method == "load_lora_adapter":
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer
        return {"result": None}


@pytest.mark.parametrize("refusal", [{"error": "outside the roots", "param": "lora_path", "status": 403},
                                     TimeoutError("replica 1 did not answer")])
def test_router_reports_a_replica_refusing_a_load_and_undoes_the_others(refusal):
    took, refused = _Replica({"result": None}), _Replica(refusal)
    router = ReplicaRouter([took, refused])
    if isinstance(refusal, BaseException):
        with pytest.raises(TimeoutError):
            asyncio.run(router.call_utility("load_lora_adapter", "b", "/x"))
    else:
        assert asyncio.run(router.call_utility("load_lora_adapter", "b", "/x")) == refusal
    assert took.calls == [("load_lora_adapter", "b", "/x"), ("unload_lora_adapter", "b")]
    assert refused.calls == [("load_lora_adapter", "b", "/x")]
    both = ReplicaRouter([_Replica({"result": None}), _Replica({"result": None})])
    assert asyncio.run(both.call_utility("load_lora_adapter", "b", "/x")) == {"result": None}


def test_serve_flags_make_loading_opt_in_and_confined(tmp_path):
    import argparse

    from kiln.runtime.entrypoint import add_serve_args, lora_roots
    from kiln.runtime.errors import RequestError
    from kiln.runtime.launch import core_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)

    def parse(*argv):
        args = parser.parse_args(list(argv))
        return lora_roots(args)

    assert parse() is None
    assert parse("--enable-lora-loading", "--lora-roots", f"{tmp_path}/a,{tmp_path}/b") == [f"{tmp_path}/a",
                                                                                            f"{tmp_path}/b"]
    for argv in (["--enable-lora-loading"], ["--lora-roots", str(tmp_path)]):
        with pytest.raises(RequestError, match="--enable-lora-loading needs --lora-roots"):
            parse(*argv)
    assert core_config("art", lora_roots=[str(tmp_path)]).engine["lora_roots"] == [str(tmp_path)]
    assert "lora_roots" not in core_config("art").engine
