"""Issue 29 item 7: every listener of a one-machine `kiln serve` binds loopback: the router's HTTP port and each
core it started (the decode core's KV receiver over TCP, each core's NIXL agent, whose UCX listened on every
network device), disaggregated and with replicas behind the router."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from listeners import LOOPBACK, listening_sockets
from live_server import child_pids, free_port, pid_alive

NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="needs the nixl-cu12 wheel")


@pytest.mark.parametrize("flags", [
    pytest.param(("--disaggregate", "--kv-transport", "tcp", "--remote-prefill", "always"), id="disagg-tcp"),
    pytest.param(("--disaggregate", "--kv-transport", "nixl", "--remote-prefill", "always"), id="disagg-nixl",
                 marks=NIXL),
    pytest.param(("--data-parallel-size", "2"), id="replicas"),
])
def test_a_one_machine_server_listens_on_loopback_only(artifact_dir, flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact_dir), *flags, "--port", str(port),
                             "--num-kv-blocks", "256", "--num-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    cores: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        cores = child_pids(proc.pid)
        assert len(cores) == 2, cores
        for _ in range(2):  # KV moves (the senders' ends exist) and both replicas may have served
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "standin", "prompt": list(range(5, 30)), "max_tokens": 4,
                                 "temperature": 0.0})
            assert r.status_code == 200, r.text
        startup = next(line for line in lines if line.startswith("kiln serve:"))
        first_core = int(re.search(r"engine core pid (\d+)", startup).group(1))  # disaggregated: the decode core
        assert first_core in cores and not any(child_pids(pid) for pid in cores)
        sockets = {pid: listening_sockets([pid]) for pid in (proc.pid, *cores)}
        assert ("0100007F", port) in sockets[proc.pid], sockets  # the HTTP port, on the default host
        if "tcp" in flags or "nixl" in flags:
            assert sockets[first_core], sockets  # the KV receiver (TCP) or the receiving NIXL agent is seen
        assert all(addr in LOOPBACK for found in sockets.values() for addr, _ in found), sockets
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
        for pid in cores:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in "".join(lines), "".join(lines)
