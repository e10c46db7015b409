"""`kiln serve` as a user runs it: a subprocess on a loopback port, stopped with SIGINT."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kiln.runtime.threads import format_cpu_list
from live_server import child_pids, free_port, interrupt, wait_serving


def thread_masks(pid: int) -> set[str]:
    """The Cpus_allowed_list values of the threads of process `pid`."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while read
            status = (task / "status").read_text()
            out.add(next(line.split(":", 1)[1].strip() for line in status.splitlines()
                         if line.startswith("Cpus_allowed_list")))
    return out


def loads_libtorch(pid: int) -> bool:
    """Whether process `pid` has torch's shared library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_kiln_serve_subprocess(standin_dir):
    port = free_port()
    cpus = sorted(os.sched_getaffinity(0))
    placed = len(cpus) >= 2  # --core-cpus: the core on the last CPU, the API server on the others
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "serve", str(standin_dir), "--port", str(port), "--api-key", "k",
         "--served-model-name", "tiny", "--max-waiting", "8", "--num-kv-blocks", "64", "--log-level", "warning",
         "--max-num-seqs", "3", "--max-num-batched-tokens", "40", *(["--core-cpus", str(cpus[-1])] if placed else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url)
        (core,) = child_pids(proc.pid)
        # the API server process never loads torch (tests/runtime/test_layers.py holds its imports to that); the
        # engine core, which runs the model, does
        assert not loads_libtorch(proc.pid) and loads_libtorch(core)
        if placed:
            assert thread_masks(core) == {str(cpus[-1])}
            assert thread_masks(proc.pid) == {format_cpu_list(cpus[:-1])}
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        r = httpx.post(url + "/v1/completions", headers=headers,
                       json={"model": "tiny", "prompt": "The quick", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401 and httpx.get(url + "/health").status_code == 200
    finally:
        interrupt(proc)
    assert proc.returncode is not None
    # One startup line: the model, the target, the KV pool in bytes and in tokens (64 blocks of 4 tokens; a
    # block holds K and V of every layer: layers x 2 x block_size x kv_heads x head_dim float32 values).
    kv = json.loads((standin_dir / "manifest.json").read_text())["kv_cache"]
    pool_bytes = 64 * kv["num_layers"] * 2 * kv["block_size"] * kv["kv_heads"] * kv["head_dim"] * 4
    lines = [line for line in proc.stdout.read().decode().splitlines() if line.startswith("kiln serve:")]
    if placed:
        assert f"1 threads on CPUs {cpus[-1]})" in lines[0]
        assert lines[1:] == [f"kiln serve: the API server runs on CPUs {format_cpu_list(cpus[:-1])}"], lines
        lines = lines[:1]
    assert len(lines) == 1, lines
    assert "'tiny'" in lines[0] and "target cpu" in lines[0]
    assert f"KV pool {pool_bytes} bytes" in lines[0] and f"= {64 * kv['block_size']} tokens" in lines[0]
    # the scheduler's bounds the core runs with: the flags', not the manifest's
    sched = json.loads((standin_dir / "manifest.json").read_text())["scheduler"]
    assert (sched["max_seqs"], sched["max_batched_tokens"]) != (3, 40)
    assert "; 3 sequences and 40 tokens a step;" in lines[0], lines[0]


def test_serve_parser():
    from kiln.cli import build_parser

    args = build_parser().parse_args(["serve", "art"])
    # host and port: None = the recipe's serve section, else 127.0.0.1:8000 (kiln.cli.serve_address)
    assert (args.host, args.port, args.api_key, args.max_waiting, args.num_kv_blocks, args.metrics_public) == (
        None, None, None, 1024, None, False)
    assert build_parser().parse_args(["serve", "art", "--metrics-public"]).metrics_public
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (None, None)  # the recipe's scheduler section
    assert build_parser().parse_args(["serve", "art", "--max-num-batched-tokens", "2048"]).max_num_batched_tokens == 2048
    assert args.stream_interval == 1 and build_parser().parse_args(["serve", "art", "--stream-interval", "4"]) \
        .stream_interval == 4


def test_serve_parser_refuses_a_stream_interval_under_1(capsys):
    from kiln.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "art", "--stream-interval", "0"])
    assert e.value.code == 2 and "--stream-interval: 0: give at least 1" in capsys.readouterr().err
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "art", flag, "0"])
        assert e.value.code == 2 and f"{flag}: 0: give at least 1" in capsys.readouterr().err


def test_serve_parser_options_and_unknown_parser_names(standin_dir, capsys):
    from kiln.runtime.entrypoint import run

    from kiln.cli import build_parser

    args = build_parser().parse_args(["serve", "art", "--tool-parser", "hermes", "--reasoning-parser", "think"])
    assert (args.tool_parser, args.reasoning_parser) == ("hermes", "think")
    assert build_parser().parse_args(["serve", "art"]).tool_parser is None  # default: the chat template's
    # an unknown name: exit 2 with the known ones, before any engine core is started
    args = build_parser().parse_args(["serve", str(standin_dir), "--tool-parser", "wizard"])
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "unknown tool parser 'wizard'" in err and "hermes" in err and "Traceback" not in err
