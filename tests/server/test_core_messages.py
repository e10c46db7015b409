"""What reaches the engine core's input socket from anyone who can connect to it: each malformed or unexpected
message is dropped (and logged once per kind), the core keeps serving, and a live client's name cannot be taken.
Over ipc (a core the test starts) and tcp (`kiln serve --role both`, whose port anyone who can reach it may use)."""
from __future__ import annotations

import marshal
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kiln.runtime.ipc.client import CoreProcess
from kiln.runtime.ipc.protocol import (
    PROTOCOL_VERSION,
    AddRequests,
    AddResult,
    CoreConfig,
    Heartbeat,
    Hello,
    NewRequest,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    Welcome,
    client_decoder,
    encode,
    encode_params,
)
from kiln.runtime.sampling_params import SamplingParams
from live_server import HOOKS, _slow_execute, free_port, pid_alive, stop_and_reap

DROP_HOOKS = str(Path(__file__).with_name("core_hooks.py")) + ":install_drop_counts"
WAIT_S = 10.0


class RawClient:
    """A client of the core on plain pyzmq sockets: a DEALER named `name`, its own PULL socket for the answers."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, workdir: str) -> None:
        self.input = ctx.socket(zmq.DEALER)
        self.input.setsockopt(zmq.IDENTITY, name.encode())
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://"):
            self.output_address = f"tcp://127.0.0.1:{self.output.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.output_address = f"ipc://{workdir}/{uuid.uuid4().hex[:8]}"
            self.output.bind(self.output_address)
        self.input.connect(address)
        self.calls = 0

    def send(self, msg: object) -> None:
        self.input.send(encode(msg))

    def recv(self, timeout: float = WAIT_S, skip_heartbeats: bool = True) -> object | None:
        """The next message (None if none within `timeout`)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.output.poll(int(left * 1000)):
                break
            msg = client_decoder.decode(self.output.recv())
            if not (skip_heartbeats and isinstance(msg, Heartbeat)):
                return msg
        return None

    def hello(self, protocol_version: int = PROTOCOL_VERSION) -> Welcome:
        self.send(Hello(self.output_address, protocol_version))
        msg = self.recv()
        assert isinstance(msg, Welcome), msg
        return msg

    def complete(self, prompt: list[int], max_tokens: int = 3) -> list[int]:
        """One greedy request; its token ids."""
        self.calls += 1
        rid = f"r{self.calls}"
        params = encode_params(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        self.send(AddRequests(self.calls, [NewRequest(rid, prompt, params)]))
        tokens: list[int] = []
        deadline = time.monotonic() + WAIT_S * 3
        while time.monotonic() < deadline:
            msg = self.recv()
            assert msg is not None, "the core stopped answering"
            if isinstance(msg, AddResult):
                assert msg.error is None, msg.error
            elif isinstance(msg, StepOutputs):
                for d in msg.deltas:
                    assert d.request_id == rid and d.error is None, d
                    tokens += d.token_ids
                    if d.finish_reason is not None:
                        return tokens
        raise AssertionError("the request did not finish")

    def utility(self, method: str) -> object:
        self.calls += 1
        self.send(UtilityCall(self.calls, method))
        msg = self.recv()
        assert isinstance(msg, UtilityResult) and msg.error is None, msg
        return msg.result

    def in_engine(self, fn, *args: object) -> object:  # noqa: ANN001
        """`fn(engine, *args)` in the core (tests/server/core_hooks.py; closure-free, no modules but time)."""
        self.calls += 1
        self.send(UtilityCall(self.calls, "test_run", [marshal.dumps(fn.__code__), {"time": "time"}, list(args)]))
        msg = self.recv()
        assert isinstance(msg, UtilityResult) and msg.error is None, msg
        return msg.result

    def close(self) -> None:
        self.input.close()
        self.output.close()


class Core:
    def __init__(self, address: str, pid: int, output: list[str] | None = None) -> None:
        self.address, self.pid, self.output = address, pid, output


@pytest.fixture(scope="module")
def ipc_core(standin_dir: Path) -> Iterator[Core]:
    config = CoreConfig(artifact=str(standin_dir), engine={"num_kv_blocks": 64}, num_threads=1,
                        plugins=[HOOKS, DROP_HOOKS], client_timeout=2.0, heartbeat_interval=0.2)
    with CoreProcess.start(config, timeout=60) as core:
        yield Core(core.info.input_address, core.pid)


@pytest.fixture(scope="module")
def tcp_core(standin_dir: Path) -> Iterator[Core]:
    """`kiln serve --role both` on a loopback port (no CURVE keys: its port takes anyone's messages)."""
    port = free_port()
    popen = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(standin_dir), "--role", "both",
                              "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "64",
                              "--num-threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(popen.stdout), daemon=True).start()
    pid = None
    try:
        deadline = time.monotonic() + 90
        while pid is None:
            m = next((m for line in list(lines) if (m := re.search(r"engine core of .* \(pid (\d+)", line))), None)
            pid = int(m.group(1)) if m else None
            assert popen.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "kiln serve --role both did not come up:\n" + "".join(lines)
            time.sleep(0.05)
        yield Core(f"tcp://127.0.0.1:{port}", pid, lines)
    finally:
        popen.terminate()
        try:
            popen.wait(15)
        except subprocess.TimeoutExpired:
            pass
        assert stop_and_reap(popen, [pid] if pid else []), "the core outlived its test"


@pytest.fixture
def zctx() -> Iterator[tuple[zmq.Context, str]]:
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kiln-test-") as workdir:
        yield ctx, workdir
        ctx.destroy(linger=0)


def _malformed(ctx: zmq.Context, address: str, victim: RawClient) -> dict[str, int]:
    """Sends each malformed message once (twice: the second must not be logged again); returns what the test expects
    the core to count by kind."""
    def dealer(identity: bytes | None) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(address)
        return s

    hello = encode(Hello(victim.output_address))
    socks = []
    for round in (b"-1", b"-2"):  # names of their own: a second connection under a name in use is refused
        req = ctx.socket(zmq.REQ)  # an extra empty frame before the payload
        req.setsockopt(zmq.LINGER, 1000)
        req.connect(address)
        req.send(hello)
        socks.append(req)
        for identity, frames in [(None, [hello]),  # no identity: zmq generates one
                                 (b"\xff\xfe-not-utf8", [hello]),
                                 (b"two-frames", [hello, b"x"]),
                                 (b"three-frames", [hello, b"x", b"y"]),
                                 (b"bad-endpoint", [encode(Hello("tcp://127.0.0.1:notaport"))]),
                                 (b"no-scheme", [encode(Hello("nonsense"))]),
                                 (b"unknown", [encode(Heartbeat())]),  # never said Hello
                                 (b"garbage", [b"\xc1\x00 not msgpack"])]:
            s = dealer(None if identity is None else identity + round)
            s.send_multipart(frames)
            socks.append(s)
        # a Hello under the live client's own name: the connection is refused, so it never reaches the core
        thief = dealer(victim.input.getsockopt(zmq.IDENTITY))
        thief.send(hello)
        socks.append(thief)
    time.sleep(1.0)  # every message delivered (a REQ's and a DEALER's connect are asynchronous)
    for s in socks:
        s.close(linger=0)
    return {"frames": 6, "identity": 4, "hello": 4, "unknown": 2, "decode": 2}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_malformed_messages_are_dropped_and_the_core_keeps_serving(transport: str, request: pytest.FixtureRequest,
                                                                   zctx: tuple[zmq.Context, str]):
    """Each message that crashed the core before (a REQ socket, a DEALER without a name or with a non-UTF-8 one, two
    and three frames, a Hello whose output address is no endpoint, a Hello under a live client's name) leaves it
    serving: the live client's request completes as before, and it still gets the core's heartbeats."""
    core: Core = request.getfixturevalue(f"{transport}_core")
    ctx, workdir = zctx
    client = RawClient(ctx, core.address, f"live-{uuid.uuid4().hex[:6]}", workdir)
    try:
        assert client.hello().error is None
        before = client.complete([1, 2, 3, 4])
        # a thief taking the live client's name would get a Welcome on its own socket: it must get nothing
        thief_out = ctx.socket(zmq.PULL)
        thief_out.setsockopt(zmq.LINGER, 0)
        thief_address = (f"tcp://127.0.0.1:{thief_out.bind_to_random_port('tcp://127.0.0.1')}"
                         if transport == "tcp" else f"ipc://{workdir}/thief")
        if transport == "ipc":
            thief_out.bind(thief_address)
        victim = RawClient.__new__(RawClient)
        victim.input, victim.output_address = client.input, thief_address
        expected = _malformed(ctx, core.address, victim)
        assert pid_alive(core.pid), "the core died"
        assert not thief_out.poll(500), "a Hello under a live client's name was welcomed"
        thief_out.close()
        assert client.complete([1, 2, 3, 4]) == before
        assert isinstance(client.recv(3.0, skip_heartbeats=False), (Heartbeat, StepOutputs))
        if transport == "ipc":
            assert client.utility("dropped") == expected
        else:  # each kind logged once, though sent two to six times (DropLog: one line a minute a kind)
            log = "".join(core.output)
            assert log.count("WARNING: dropped") == len(expected), log
            for needles in [("frames (a client",), ("without a name", "is not UTF-8"),
                            ("is no endpoint", "is not ipc:// or tcp://"), ("which has not said Hello",),
                            ("does not decode",)]:
                assert sum(log.count(n) for n in needles) == 1, (needles, log)
    finally:
        client.close()


def test_a_client_of_another_protocol_version_is_refused(ipc_core: Core, zctx: tuple[zmq.Context, str]):
    ctx, workdir = zctx
    client = RawClient(ctx, ipc_core.address, "old-client", workdir)
    try:
        welcome = client.hello(PROTOCOL_VERSION - 1)
        assert welcome.info is None and f"protocol version {PROTOCOL_VERSION}, the client {PROTOCOL_VERSION - 1}" \
            in welcome.error
        client.send(UtilityCall(1, "stats"))  # refused: the core does not know it
        assert client.recv(1.0) is None
        assert client.hello().error is None  # the same name with this version is welcomed
        assert isinstance(client.utility("stats"), dict)
    finally:
        client.close()


def test_a_silent_client_expires_and_its_requests_are_aborted(ipc_core: Core, zctx: tuple[zmq.Context, str]):
    """client_timeout 2 s: a client that sends nothing for longer is dropped: its request (5 s of steps left) is
    aborted and nothing more is sent to it, and what it sends next is a stranger's. One that keeps sending
    heartbeats stays."""
    ctx, workdir = zctx
    silent = RawClient(ctx, ipc_core.address, "silent", workdir)
    alive = RawClient(ctx, ipc_core.address, "alive", workdir)
    try:
        assert silent.hello().error is None and alive.hello().error is None
        alive.in_engine(_slow_execute, 0.05)
        params = encode_params(SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        silent.send(AddRequests(1, [NewRequest("long", [1, 2, 3], params)]))
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            alive.send(Heartbeat())
            time.sleep(0.2)
        requests = alive.in_engine(lambda engine: sorted(engine.requests))
        alive.in_engine(lambda engine: engine.runner.__dict__.pop("execute", None) and None)
        assert requests == []
        assert silent.output.poll(0), "the silent client was never answered"
        while silent.output.poll(0):
            silent.output.recv()
        assert silent.recv(1.0, skip_heartbeats=False) is None, "the core still sends to an expired client"
        before = alive.utility("dropped").get("unknown", 0)
        silent.send(UtilityCall(9, "stats"))
        assert silent.recv(1.0) is None
        assert alive.utility("dropped").get("unknown", 0) == before + 1
    finally:
        silent.close()
        alive.close()


def test_drop_log_logs_each_kind_once_a_minute(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    from kiln.runtime.core import process

    now = [1000.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: now[0])
    log = process.DropLog(every=60.0)
    with caplog.at_level("WARNING", logger="kiln.core"):
        for _ in range(5):
            log("frames", "a message of %d frames", 3)
        log("identity", "a nameless one")
        now[0] += 61
        log("frames", "a message of %d frames", 4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["dropped a message of 3 frames", "dropped a nameless one",
                     "dropped a message of 4 frames (4 more of this kind since the last)"]
    assert log.counts == {"frames": 6, "identity": 1}


def test_client_name_refuses_what_is_not_a_named_client():
    from kiln.runtime.core.process import client_name

    assert client_name([b"api-0", b"x"]) == "api-0"
    for frames in ([b"api-0", b"", b"x"], [b"api-0"], [b"\x00\x80\x00\x00\x01", b"x"], [b"\xff", b"x"],
                   [b"a\x1fb", b"x"]):
        assert isinstance(client_name(frames), tuple), frames
