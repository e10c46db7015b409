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


def test_kiln_serve_disaggregate_and_router_killed(artifact_dir, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["disaggregate"] = {"prefill": 1, "decode": 1, "transport": "nixl", "remote_prefill": "always"}
    (art / "manifest.json").write_text(json.dumps(manifest))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(art), "--disaggregate", "--port",
                             str(port), "--num-kv-blocks", "256", "--num-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    children: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not any(line.startswith("kiln serve:") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        startup = next(line for line in lines if line.startswith("kiln serve:"))
        children = child_pids(proc.pid)
        assert len(children) == 2 and int(re.search(r"engine core pid (\d+)", startup).group(1)) in children
        while True:  # the startup line comes before the router connected its cores and bound the port
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        print(f"ready after {time.monotonic() - deadline + 90:.1f} s")
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
        os.kill(proc.pid, signal.SIGKILL)  # the router
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in children):
            assert time.monotonic() < deadline, "a core outlived its router"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in "".join(lines)
