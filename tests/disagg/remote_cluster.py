"""Engine cores and routers as separate processes on localhost, started the way two machines start them:
`kiln serve ART --role prefill|decode|both --host H --port P` and `kiln router ...`. Everything started is stopped
by `Cluster.close()` (SIGKILL after a bounded wait), and `close()` asserts that no process is left."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
from live_server import free_port, pid_alive, stop_and_reap

START_S = 120.0  # a process loads torch and the artifact on a shared 2-core machine


@dataclass
class Proc:
    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    pid: int | None = None  # a role's engine core (the child of `kiln serve --role`)
    url: str = ""

    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = START_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.popen.poll() is None, f"exited {self.popen.returncode} before {pattern!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.output()}"
            time.sleep(0.05)


def spawn(*args: str) -> Proc:
    popen = subprocess.Popen([sys.executable, "-m", "kiln.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    proc = Proc(popen)
    threading.Thread(target=lambda: proc.lines.extend(popen.stdout), daemon=True).start()
    return proc


class Cluster:
    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def core(self, artifact, role: str, *flags: str, wait: bool = True) -> Proc:
        port = free_port()
        proc = spawn("serve", str(artifact), "--role", role, "--host", "127.0.0.1", "--port", str(port),
                     "--num-kv-blocks", "256", "--num-threads", "1", *flags)
        proc.url = f"127.0.0.1:{port}"
        self.procs.append(proc)
        if wait:
            self.ready(proc)
        return proc

    def ready(self, proc: Proc) -> Proc:
        proc.pid = int(proc.wait_line(r"engine core of .* \(pid (\d+)").group(1))
        return proc

    def router(self, *flags: str, wait: bool = True) -> Proc:
        port = free_port()
        proc = spawn("router", *flags, "--port", str(port), "--heartbeat-timeout", "2", "--log-level", "warning")
        proc.url = f"http://127.0.0.1:{port}"
        self.procs.append(proc)
        if wait:
            deadline = time.monotonic() + START_S
            while True:
                try:
                    if httpx.get(proc.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.popen.poll() is None, f"the router exited {proc.popen.returncode}:\n{proc.output()}"
                assert time.monotonic() < deadline, f"the router did not come up:\n{proc.output()}"
                time.sleep(0.1)
        return proc

    def close(self) -> None:
        pids = [p.pid for p in self.procs if p.pid is not None]
        for p in reversed(self.procs):  # routers first (they were started last)
            if p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        gone = all([stop_and_reap(p.popen, [p.pid] if p.pid else [], timeout=10) for p in self.procs])
        assert gone and not any(pid_alive(pid) for pid in pids), "a core outlived its test"


def core_utility(url: str, method: str, *args, timeout: float = 10.0, keys=None):
    """Runs a utility of the core at `url` (host:port) as a client of its own (CURVE with `keys`)."""
    from kiln.runtime.ipc.client import AsyncCoreClient
    from kiln.runtime.ipc.protocol import UtilityCall, UtilityResult

    async def call():
        client = AsyncCoreClient("tcp://" + url, name=f"test-{uuid.uuid4().hex[:8]}", keys=keys)
        try:
            await client.connect(timeout)
            client.send(UtilityCall(1, method, list(args)))
            while True:
                msg = await asyncio.wait_for(client.recv(), timeout)
                if isinstance(msg, UtilityResult) and msg.call_id == 1:
                    assert msg.error is None, msg.error
                    return msg.result
        finally:
            client.close()

    return asyncio.run(call())
