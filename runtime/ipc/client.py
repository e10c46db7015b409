"""The API server's side of the engine-core protocol: the core process it owns, and its connection to a core."""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..errors import KilnRuntimeError
from . import curve
from .protocol import (
    CoreConfig,
    CoreInfo,
    CoreMessage,
    Goodbye,
    Heartbeat,
    Hello,
    StartupFailed,
    Welcome,
    client_decoder,
    encode,
    launcher_decoder,
)


class EngineDeadError(KilnRuntimeError):
    """The engine core died or stopped answering: every request in flight fails with this."""


class CoreProcess:
    """An engine-core child process (core/process.py) that this process starts, owns and reaps.

    `start()` launches it in a process group of its own (so that Ctrl-C reaches only the API server, which
    decides, and so that `close()` kills it with any process it started), waits until it reports `Ready` and
    raises `KilnRuntimeError` with its message if it cannot start. The child dies with us if we die first
    (PR_SET_PDEATHSIG; start it from a thread that outlives it, e.g. the main thread). `close()` sends the
    group SIGTERM, then SIGKILL after `timeout`.
    """

    def __init__(self, popen: subprocess.Popen, info: CoreInfo, workdir: str) -> None:
        self.popen = popen
        self.info = info
        self.workdir = workdir

    @classmethod
    def start(cls, config: CoreConfig, *, timeout: float = 900.0, env: dict[str, str] | None = None) -> CoreProcess:
        workdir = tempfile.mkdtemp(prefix="kiln-core-")
        config.input_address = config.input_address or f"ipc://{workdir}/input"
        config.parent_pid = os.getpid()
        read_fd, write_fd = os.pipe()
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "kiln.runtime.core.process", "--config", msgspec.json.encode(config).decode(),
                 "--ready-fd", str(write_fd)], pass_fds=(write_fd,), process_group=0, env=env)
        except BaseException:
            os.close(read_fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(write_fd)
        try:
            data = _read_until_eof(read_fd, time.monotonic() + timeout)
        except BaseException:
            _kill_group(popen, 0)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(read_fd)
        if not data:
            status = _describe_exit(popen.wait())
            shutil.rmtree(workdir, ignore_errors=True)
            raise KilnRuntimeError(f"the engine core {status} before it was ready (its log is above)")
        msg = launcher_decoder.decode(data)
        if isinstance(msg, StartupFailed):
            _kill_group(popen, 10)
            shutil.rmtree(workdir, ignore_errors=True)
            raise KilnRuntimeError(msg.message)
        return cls(popen, msg.info, workdir)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def describe_exit(self) -> str:
        return _describe_exit(self.popen.returncode)

    def close(self, timeout: float = 5.0) -> None:
        _kill_group(self.popen, timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> CoreProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_until_eof(fd: int, deadline: float) -> bytes:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KilnRuntimeError("the engine core did not become ready in time")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _kill_group(popen: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the child's process group, SIGKILL after `timeout`; reaps the child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, sig)
        try:
            popen.wait(timeout if sig == signal.SIGTERM else None)
            return
        except subprocess.TimeoutExpired:
            continue


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _output_address(sock: zmq.Socket, input_address: str, workdir: str, keys: curve.CurveKeys | None) -> str:
    """Binds the client's output socket where its core can reach it: beside `workdir` (ipc) for a core on this
    machine, else (a tcp:// core, another machine's) on a random port of the local address that routes to the
    core's host, a CURVE server there with `keys`."""
    if not input_address.startswith("tcp://"):
        address = f"ipc://{workdir}/output"
        sock.bind(address)
        return address
    host = input_address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: it only picks the route
        try:
            probe.connect((host, 9))
        except OSError as e:
            raise KilnRuntimeError(f"no route to the engine core at {input_address}: {e}") from None
        local = probe.getsockname()[0]
    if family == socket.AF_INET6:
        sock.setsockopt(zmq.IPV6, 1)
        local = f"[{local}]"
    curve.secure_server(sock, input_address, keys)
    port = sock.bind_to_random_port(f"tcp://{local}")
    return f"tcp://{local}:{port}"


class AsyncCoreClient:
    """One client's connection to an engine core, used from one asyncio loop: requests go out on a DEALER
    socket named `name` (the core namespaces this client's request ids with it), the core's messages come in on
    this client's own PULL socket. `last_seen` is when the core was last heard from (any message: its
    heartbeats come every `heartbeat_interval`); `send_heartbeat()` tells the core this client is alive. Over tcp
    both sockets are CURVE with `keys` (default: KILN_CURVE_KEYS; ipc/curve.py), and a core that refuses this
    client's security (or lack of it) fails `connect()` at once with the reason."""

    def __init__(self, input_address: str, *, name: str = "api-0", keys: curve.CurveKeys | None = None) -> None:
        keys = keys or curve.from_env()
        self.input_address = input_address
        self.name = name
        self.info: CoreInfo | None = None
        self.last_seen = time.monotonic()
        self._workdir = tempfile.mkdtemp(prefix="kiln-client-")
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._input = self._sync_ctx.socket(zmq.DEALER)
        self._input.setsockopt(zmq.IDENTITY, name.encode())
        self._input.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self.output_address = _output_address(self._output, input_address, self._workdir, keys)
        curve.secure_client(self._input, input_address, keys)
        self._handshakes = curve.HandshakeWatch(self._input, keys) if curve.is_tcp(input_address) else None
        self._input.connect(input_address)

    async def connect(self, timeout: float = 30.0) -> CoreInfo:
        """Introduces this client; returns what the core says about itself."""
        self.send(Hello(self.output_address))
        deadline = time.monotonic() + timeout
        while True:
            self._check_handshakes()
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"the engine core at {self.input_address} did not answer within "
                                      f"{timeout:g} s")
            try:  # in slices: a refused handshake is never answered, but its monitor says why
                msg = await asyncio.wait_for(self.recv(), min(left, 0.1))
            except TimeoutError:
                continue
            if isinstance(msg, Welcome):
                if msg.error is not None:
                    raise KilnRuntimeError(msg.error)
                self.info = msg.info
                self._stop_watching()  # a monitor nobody reads would block libzmq once its queue is full
                return msg.info

    def _check_handshakes(self) -> None:
        failure = self._handshakes.failure(self.input_address, "engine core") if self._handshakes else None
        if failure is not None:
            raise KilnRuntimeError(failure)

    def _stop_watching(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None

    def send(self, msg: Any) -> None:
        self._input.send(encode(msg), zmq.NOBLOCK)

    def send_heartbeat(self) -> None:
        self.send(Heartbeat())

    async def recv(self) -> CoreMessage:
        payload = await self._output.recv(copy=False)
        self.last_seen = time.monotonic()
        return client_decoder.decode(payload.buffer)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.send(Goodbye())
        self._stop_watching()
        self._input.close(linger=100)
        self._output.close()
        curve.stop_authenticator(self._async_ctx)
        # destroy, not term: a socket some other thread still holds (a utility call cut short) is closed with linger 0
        # instead of term() waiting on it forever; the Goodbye above keeps its 100 ms to leave
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.destroy(linger=0)
        shutil.rmtree(self._workdir, ignore_errors=True)
