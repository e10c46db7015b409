"""The recipe's `disaggregate { }` compiles into the manifest, and `kiln serve ART --disaggregate` runs a router
plus a prefill and a decode core (KV over NIXL between the two processes here), answering what the co-located
engine answers; the router SIGKILLed takes both cores with it (no process left behind)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
from live_server import child_pids, free_port, pid_alive

import kiln

RECIPE = """
recipe r {
  model   = llama(vocab=96, hidden=32, layers=2, heads=2, ffn=64, max_position=128)
  weights = random(seed=1)
  target  = cpu
  disaggregate { prefill = 1; decode = 1; transport = nixl; remote_prefill = always }
}
"""


def test_recipe_section_reaches_the_manifest(tmp_path):
    p = tmp_path / "r.dsl"
    p.write_text(textwrap.dedent(RECIPE))
    res = kiln.compile(p, tmp_path / "art", progress=False)
    assert res.manifest["disaggregate"] == {"prefill": 1, "decode": 1, "transport": "nixl",
                                            "remote_prefill": "always"}


def test_remote_prefill_defaults_to_auto(tmp_path):
    """A recipe that does not say is conditionally disaggregated (the issue's default); so are `kiln serve
    --disaggregate` without a recipe section and `kiln router`."""
    import argparse

    from kiln.compiler.options import recipe_options
    from kiln.dsl import load_recipe
    from kiln.runtime.disagg.remote import add_router_args
    from kiln.runtime.entrypoint import add_serve_args, disaggregate_section

    p = tmp_path / "r.dsl"
    p.write_text(textwrap.dedent(RECIPE).replace("; remote_prefill = always", ""))
    assert recipe_options(load_recipe(str(p)).recipe).disaggregate.remote_prefill == "auto"
    serve = argparse.ArgumentParser()
    serve.add_argument("artifact")
    add_serve_args(serve)
    assert disaggregate_section({}, serve.parse_args(["art", "--disaggregate"]))["remote_prefill"] == "auto"
    assert disaggregate_section({}, serve.parse_args(["art"])) is None
    given = serve.parse_args(["art", "--disaggregate", "--remote-prefill", "always"])
    assert disaggregate_section({"disaggregate": {"remote_prefill": "auto"}}, given)["remote_prefill"] == "always"
    router = argparse.ArgumentParser().add_subparsers()
    add_router_args(router)
    assert router.choices["router"].parse_args(["--replica", "h:1"]).remote_prefill == "auto"


def _kiln_serve(art, *flags: str):
    """`kiln serve ART FLAGS` in its own process, on a free port: (process, port, output lines, child pids), once
    /health answers 200."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(art), *flags, "--port", str(port),
                             "--num-kv-blocks", "256", "--num-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, port, lines, reader


def _wait_ready(proc, port: int, lines: list[str], num_children: int) -> tuple[str, list[int]]:
    deadline = time.monotonic() + 90
    while not any(line.startswith("kiln serve:") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    startup = next(line for line in lines if line.startswith("kiln serve:"))
    while True:  # the startup line comes before the router connected its cores and bound the port
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    children = child_pids(proc.pid)
    assert len(children) == num_children and int(re.search(r"engine core pid (\d+)", startup).group(1)) in children
    return startup, children


def _kill_router(proc, children: list[int]) -> None:
    """SIGKILLs `kiln serve`; its cores must follow within 10 s."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a core outlived its router"
        time.sleep(0.05)


def _cleanup(proc, reader, children: list[int], lines: list[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    reader.join(5)
    for pid in children:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in "".join(lines)


def test_kiln_serve_disaggregate_and_router_killed(artifact_dir, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["disaggregate"] = {"prefill": 1, "decode": 1, "transport": "nixl", "remote_prefill": "always"}
    (art / "manifest.json").write_text(json.dumps(manifest))
    proc, port, lines, reader = _kiln_serve(art, "--disaggregate")
    children: list[int] = []
    try:
        _, children = _wait_ready(proc, port, lines, 2)
        prompt = list(range(5, 30))
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "art", "prompt": prompt, "max_tokens": 6, "temperature": 0.0})
        assert r.status_code == 200, r.text
        want = kiln.LLM(str(artifact_dir), num_kv_blocks=64).generate(
            [prompt], kiln.SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == want
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert re.search(r"^kiln:kv_transfer_started_total 1\.0$", metrics, re.M) or \
            "kiln:kv_transfer_started_total" in metrics, metrics
        _kill_router(proc, children)
    finally:
        _cleanup(proc, reader, children, lines)


def test_kiln_serve_replicas_routes_and_dies_with_its_router(artifact_dir):
    """`kiln serve ART --replicas 2`: two cores behind the KV-aware router; a prompt sent twice is served from one
    replica's prefix cache the second time; the router SIGKILLed takes both cores with it."""
    proc, port, lines, reader = _kiln_serve(artifact_dir, "--replicas", "2")
    children: list[int] = []
    try:
        _, children = _wait_ready(proc, port, lines, 2)
        assert any("2 replicas behind a KV-aware router" in line for line in lines), lines
        prompt = list(range(5, 50))
        want = kiln.LLM(str(artifact_dir), num_kv_blocks=64).generate(
            [prompt], kiln.SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "standin", "prompt": prompt, "max_tokens": 6, "temperature": 0.0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        deadline = time.monotonic() + 10
        while True:  # the second one went where the first left its blocks: that replica's own counter says so
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            routed = {m[0]: float(m[1]) for m in
                      re.findall(r'^kiln:router_requests_total\{replica="(\d)"\} (\S+)$', metrics, re.M)}
            hits = {m[0]: float(m[1]) for m in
                    re.findall(r'^kiln:replica_prefix_cache_hits_total\{replica="(\d)"\} (\S+)$', metrics, re.M)}
            if any(hits.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sorted(routed.values()) == [0.0, 2.0], metrics
        holder = next(k for k, v in routed.items() if v == 2.0)
        assert hits[holder] >= (len(prompt) - 1) // 4 * 4 and sum(hits.values()) == hits[holder], metrics
        _kill_router(proc, children)
    finally:
        _cleanup(proc, reader, children, lines)
