"""How `kiln serve` stops and how it refuses to start: SIGTERM (a process manager's stop) as SIGINT, exit 0 with
the engine core stopped and its socket directory removed; a port in use refused before the engine is loaded."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_server import child_pids, free_port, pid_alive, stop_and_reap, wait_serving


def _core_workdir(core_pid: int) -> Path:
    """The engine core's socket directory: where its input address (in its --config) lies."""
    argv = Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")
    config = json.loads(argv[argv.index(b"--config") + 1])
    address = config["input_address"]
    assert address.startswith("ipc://"), address
    return Path(address.removeprefix("ipc://")).parent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_exits_0_and_removes_the_core_socket_directory(standin_dir: Path, sig: signal.Signals):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(standin_dir), "--port", str(port),
                             "--num-kv-blocks", "64", "--num-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        wait_serving(proc, f"http://127.0.0.1:{port}")
        pids = child_pids(proc.pid)
        (core,) = pids
        workdir = _core_workdir(core)
        assert workdir.is_dir()
        proc.send_signal(sig)
        assert proc.wait(30) == 0, proc.stdout.read().decode()
        assert not workdir.exists(), f"{workdir} left behind"
        deadline = time.monotonic() + 10
        while pid_alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(core), "the engine core outlived kiln serve"
    finally:
        assert stop_and_reap(proc, pids)


def test_a_port_in_use_fails_fast_before_the_engine_loads(standin_dir: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(standin_dir), "--port", str(port),
                               "--num-threads", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "kiln serve: model" not in proc.stdout, "the engine was loaded before the port was checked"
    assert time.monotonic() - start < 30
