"""The data plane of a KV transfer: frames (msgspec), their digests, and transports behind one interface.

A transport carries opaque frames one way, prefill -> decode: `send(frame)` on the sending end, `recv(timeout)`
on the receiving end. None of them is trusted: frames may be lost, late, duplicated, reordered, corrupted or cut
off by a closed connection, and the decode side's checks (lease, generation, digest; core/lease.py) make every such
fault either harmless or a failed transfer, never KV written where it does not belong.

* `InProcTransport`: a queue, for one process; with a `FaultInjector` (seeded) for tests.
* `ZmqTransport`: TCP through pyzmq (PUSH -> PULL), already a runtime dependency; CURVE with keys (curve.py). Its
  receiving end drops a message of several parts, and one above `max_frame_bytes` closes its sender's connection.
* NIXL: nixl_transport.py.
"""
from __future__ import annotations

import hashlib
import json
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ..droplog import DropLog
from ..errors import KilnRuntimeError

if TYPE_CHECKING:
    import torch

TRANSPORTS = ("tcp", "nixl")  # the KV transports a decode core can receive on
# Upper bounds (seconds) of the decode side's transfer-time histogram: lease reserved -> committed.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DisaggError(KilnRuntimeError):
    """A prefill and a decode core that cannot pair (different KV layouts), or a bad descriptor."""


class KVLayout(msgspec.Struct, frozen=True):
    """What both sides of a transfer must agree on, byte for byte: one block is `num_layers` tensors of
    `block_shape` (block_size first) of `dtype`; and the weights that computed it: `weights_digest` (of the
    manifest's sha256 of every weight file, fp8 scales included, see `weights_digest`), so two artifacts with
    the same layout but other weights never exchange K/V."""

    num_layers: int
    block_shape: list[int]
    dtype: str
    block_size: int
    weights_digest: str = ""

    @classmethod
    def of(cls, engine) -> KVLayout:
        if not hasattr(engine.runner, "kv_caches"):  # a mesh executor: each rank holds its shard of the pool
            raise DisaggError("disaggregation serves single-device artifacts only (this one is parallel)")
        kv = engine.artifact.kv_cache_config
        return cls(kv.num_layers, list(kv.shape), str(kv.dtype).removeprefix("torch."), kv.block_size,
                   weights_digest(engine.artifact.manifest))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # the router reads layouts too, and never loads torch

        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        n = self.num_layers * self.torch_dtype.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def check_pairs_with(self, other: KVLayout) -> None:
        if msgspec.structs.replace(self, weights_digest=other.weights_digest) != other:
            raise DisaggError(f"the prefill and decode cores' KV layouts differ ({self} vs {other}); they "
                              "must serve artifacts with the same KV layout")
        if self.weights_digest != other.weights_digest:
            raise DisaggError(f"the prefill and decode cores serve artifacts with other weights (weights digest "
                              f"{self.weights_digest[:16] or 'none'}... vs {other.weights_digest[:16] or 'none'}...): "
                              "one's K/V is wrong for the other; serve the same compiled artifact on both")


def weights_digest(manifest: dict) -> str:
    """sha256 over the manifest's weight digests (file -> sha256, every rank's for a parallel artifact): the
    weights a core computes K/V with, fp8 scales included (they are tensors of the weight files)."""
    sections = [manifest.get("weights") or {}] + list((manifest.get("parallel") or {}).get("ranks") or [])
    digests = [sorted((s.get("sha256") or {}).items()) for s in sections]
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()


class RemotePrefill(msgspec.Struct, frozen=True):
    """The decode core's leased destination: blocks `first_block..` of the prompt's block table, i.e. tokens
    `[first_block * block_size, prompt_len - 1)`."""

    transfer_id: str
    prompt_len: int
    first_block: int
    block_ids: list[int]
    generations: list[int]
    layout: KVLayout
    endpoint: str | None = None  # where the prefill core sends the frames (None: the one transport it has)


class BlockFrame(msgspec.Struct, tag="block", frozen=True):
    """One block's K/V (every layer, `KVLayout` order) for block `index` of a transfer's leased range."""
    transfer_id: str
    index: int
    block_id: int
    generation: int
    digest: bytes
    payload: bytes


class DoneFrame(msgspec.Struct, tag="done", frozen=True):
    """Every block was sent: their digests, in index order."""
    transfer_id: str
    digests: list[bytes]


class FailFrame(msgspec.Struct, tag="fail", frozen=True):
    """The prefill side gave up on the transfer (its request failed or was aborted)."""
    transfer_id: str
    reason: str


Frame = BlockFrame | DoneFrame | FailFrame
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame | None:
    """None for bytes that are not a frame (a corrupted one)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def block_digest(transfer_id: str, index: int, generation: int, payload: bytes) -> bytes:
    """Binds a block's bytes to the transfer, block index and generation they were sent for.

    It is an unkeyed hash, an integrity check against accidents (a corrupted, truncated, misrouted or stale frame),
    not a MAC: anyone who can deliver a frame can compute it. What keeps forged frames out is the channel: over
    `ZmqTransport` with CURVE keys (curve.py) only a sender holding the deployment's client secret key gets a frame
    to the receiver at all, and each message is authenticated (Poly1305) and encrypted on the wire, so a frame that
    reaches the checks came from a prefill core of the deployment, unaltered. Without keys (loopback, or
    `--insecure`), and over NIXL (UCX: outside CURVE), a peer that reaches the receiver and learns a live transfer's id,
    blocks and generations (they cross the control plane, in the clear without keys) could write KV that passes
    these checks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{transfer_id}\0{index}\0{generation}\0".encode())
    h.update(payload)
    return h.digest()


class TransportClosed(ConnectionError):
    pass


class Transport:
    """One direction of frames. `send` never blocks longer than the transport's timeout; `recv` returns what
    arrived within `timeout` seconds (possibly nothing). `dropped` (the receiving end's owner sets it: DecodeRole)
    counts and logs what a receiving end drops before it is a frame (a message of several parts)."""

    dropped: DropLog | None = None

    def send(self, frame: bytes) -> None:
        raise NotImplementedError

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcTransport(Transport):
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.closed = False

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise TransportClosed("in-process transport closed")
        self._q.put(frame)

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        out = []
        try:
            out.append(self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait())
            while True:
                out.append(self._q.get_nowait())
        except queue.Empty:
            pass
        return out

    def close(self) -> None:
        self.closed = True


@dataclass
class Faults:
    """Per-frame probabilities of each fault; `close_after`: frames sent before the connection closes."""
    drop: float = 0.0
    delay: float = 0.0       # held back and delivered after the next few frames (or at flush)
    duplicate: float = 0.0
    reorder: float = 0.0     # swapped with the next frame
    corrupt: float = 0.0     # one byte flipped
    close_after: int | None = None


class FaultInjector(Transport):
    """Wraps a transport's sending end and applies `Faults` with a seeded RNG (reproducible)."""

    def __init__(self, inner: Transport, faults: Faults, seed: int = 0) -> None:
        self.inner, self.faults, self.rng = inner, faults, random.Random(seed)
        self.sent = 0
        self._held: list[tuple[int, bytes]] = []  # (frames left to wait, frame)
        self._swap: bytes | None = None
        self.log: list[str] = []

    def send(self, frame: bytes) -> None:
        f, rng = self.faults, self.rng
        if f.close_after is not None and self.sent >= f.close_after:
            self.inner.close()
            raise TransportClosed("fault injector closed the connection")
        self.sent += 1
        if rng.random() < f.drop:
            self.log.append("drop")
            return self._tick()
        if rng.random() < f.corrupt and frame:
            i = rng.randrange(len(frame))
            frame = frame[:i] + bytes([frame[i] ^ (1 << rng.randrange(8))]) + frame[i + 1:]
            self.log.append("corrupt")
        if rng.random() < f.delay:
            self._held.append((rng.randint(1, 3), frame))
            self.log.append("delay")
            return self._tick()
        if self._swap is None and rng.random() < f.reorder:
            self._swap = frame
            self.log.append("reorder")
            return self._tick()
        self.inner.send(frame)
        if rng.random() < f.duplicate:
            self.inner.send(frame)
            self.log.append("duplicate")
        if self._swap is not None:
            self.inner.send(self._swap)
            self._swap = None
        self._tick()

    def _tick(self) -> None:
        due = [fr for n, fr in self._held if n <= 1]
        self._held = [(n - 1, fr) for n, fr in self._held if n > 1]
        for fr in due:
            self.inner.send(fr)

    def flush(self) -> None:
        """Delivers what is still held back (late frames)."""
        for _, fr in self._held:
            self.inner.send(fr)
        self._held = []
        if self._swap is not None:
            self.inner.send(self._swap)
            self._swap = None

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        return self.inner.recv(timeout)

    def close(self) -> None:
        self.inner.close()


class ZmqTransport(Transport):
    """TCP via pyzmq. The receiving end binds (`ZmqTransport.bind()`; its `endpoint` goes to the sender through
    the control plane), the sending end connects. `send` gives up after `send_timeout_s` (a dead peer, or one
    that refuses this end's CURVE key: the error says which). With `keys` (default: KILN_CURVE_KEYS) a tcp
    endpoint is CURVE (curve.py): the receiver admits only authorized senders, every frame is encrypted and
    authenticated on the wire."""

    def __init__(self, endpoint: str, *, bind: bool, send_timeout_s: float = 5.0, keys=None,
                 max_frame_bytes: int | None = None) -> None:
        """`max_frame_bytes` (the receiving end): a longer message closes its sender's connection unread."""
        import zmq

        from ..ipc import curve
        keys = keys or curve.from_env()
        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL if bind else zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._handshakes = None
        if bind:
            if max_frame_bytes is not None:
                self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            curve.secure_server(self.sock, endpoint, keys)
            port = self.sock.bind_to_random_port(endpoint) if endpoint.count(":") == 1 else None
            self.endpoint = f"{endpoint}:{port}" if port is not None else endpoint
            if port is None:
                self.sock.bind(endpoint)
        else:
            self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
            curve.secure_client(self.sock, endpoint, keys)
            if curve.is_tcp(endpoint):  # until a frame went through: why the receiver refuses, if it does
                self._handshakes = curve.HandshakeWatch(self.sock, keys)
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        self._lock = threading.Lock()

    @classmethod
    def bind(cls, host: str = "tcp://127.0.0.1", keys=None, max_frame_bytes: int | None = None) -> ZmqTransport:
        return cls(host, bind=True, keys=keys, max_frame_bytes=max_frame_bytes)

    def send(self, frame: bytes) -> None:
        with self._lock:
            try:
                if self._handshakes is not None:
                    self._first_send(frame)
                else:
                    self.sock.send(frame, copy=False)
            except self._zmq.Again as error:
                raise TransportClosed(f"no KV receiver at {self.endpoint}") from error
            except self._zmq.ZMQError as error:
                raise TransportClosed(str(error)) from error

    def _first_send(self, frame: bytes) -> None:
        """Until the connection is up: a receiver that refuses this end's security fails the send at once, with
        the reason, rather than after the send timeout."""
        zmq, watch = self._zmq, self._handshakes
        deadline = time.monotonic() + self.sock.getsockopt(zmq.SNDTIMEO) / 1000
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                why = watch.failure(self.endpoint, "KV receiver")
                if why is not None:
                    raise TransportClosed(why) from None
                if time.monotonic() >= deadline:
                    why = watch.failure(self.endpoint, "KV receiver", final=True)
                    if why is not None:  # it answered, refusing: say why rather than "no KV receiver"
                        raise TransportClosed(why) from None
                    raise
                time.sleep(0.005)
        watch.close()  # connected: a monitor nobody reads would fill up
        self._handshakes = None

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        """The frames that arrived; a message of more than one part (a frame is one) is dropped whole."""
        out = []
        if self.sock.poll(int(timeout * 1000)):
            deadline = time.monotonic() + 0.05
            while self.sock.poll(0) and time.monotonic() < deadline:
                parts = self.sock.recv_multipart(copy=True)
                if len(parts) == 1:
                    out.append(parts[0])
                elif self.dropped is not None:
                    self.dropped("frames", "a KV message of %d parts (a frame is one)", len(parts))
        return out

    def close(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
        self.sock.close(0)
