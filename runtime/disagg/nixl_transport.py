"""KV frames over NIXL (the `nixl-cu12` wheel; its UCX plugin moves registered host memory, no GPU needed).

The receiving end registers a staging ring of `num_slots` slots in host memory and publishes, through the
control plane, its agent metadata and the ring's address (`endpoint`, a string). The sending end registers a ring
of its own, copies a frame into a free slot, RDMA-WRITEs it into the same slot of the receiver with a
notification naming slot and length, and reuses the slot only when the receiver's credit for it came back (it
copied the frame out). The receiver hands the frame to the same checks as every transport (lease, generation,
digest): NIXL never writes into the KV pool itself, so a late write from an aborted or dead sender can land only in
a staging slot, where the digest check refuses it. The cost is one host copy each side; writing straight into
leased KV blocks (zero copy) is not done.

UCX listens on every network device it may use. A receiver for a loopback deployment (`loopback`, the default: a
one-machine `kiln serve --disaggregate`, or `--kv-host 127.0.0.1`) restricts its agent to the loopback device
(UCX_NET_DEVICES, unless the environment sets it), and says so in its endpoint, so its sender does the same.
"""
from __future__ import annotations

import base64
import os
import struct
import time
import uuid

import msgspec
import torch

from .transport import Transport, TransportClosed

_HDR = struct.Struct("<cII")  # kind, slot, length


def _nixl():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as error:  # pragma: no cover - the wheel is in requirements-cpu.txt
        raise TransportClosed(f"the NIXL transport needs the nixl-cu12 wheel: {error}") from error
    return nixl_agent, nixl_agent_config


class _Endpoint(msgspec.Struct):
    agent: str
    metadata: bytes
    address: int
    num_slots: int
    slot_bytes: int
    loopback: bool = False


def _loopback_devices() -> str:
    """The loopback network devices (Linux: type 772, ARPHRD_LOOPBACK), comma separated; `lo` if none is seen."""
    try:
        names = sorted(n for n in os.listdir("/sys/class/net")
                       if open(f"/sys/class/net/{n}/type").read().strip() == "772")
    except OSError:
        names = []
    return ",".join(names) or "lo"


def _agent(prefix: str, loopback: bool):
    """A NIXL agent with its UCX backend; `loopback`: on the loopback device only (UCX reads UCX_NET_DEVICES when
    the backend is made; the backend's own `ucx_devices` parameter does not keep its TCP off other devices)."""
    nixl_agent, nixl_agent_config = _nixl()
    name = f"kiln-{prefix}-{uuid.uuid4().hex[:12]}"
    if not loopback or "UCX_NET_DEVICES" in os.environ:
        return name, nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    os.environ["UCX_NET_DEVICES"] = _loopback_devices()
    try:
        return name, nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        del os.environ["UCX_NET_DEVICES"]


class NixlReceiver(Transport):
    def __init__(self, slot_bytes: int, num_slots: int = 64, loopback: bool = True) -> None:
        self.name, self.agent = _agent("kv-recv", loopback)
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.staging = torch.zeros(num_slots * slot_bytes, dtype=torch.uint8)
        self._reg = self.agent.register_memory(self.staging)
        info = _Endpoint(self.name, self.agent.get_agent_metadata(), self.staging.data_ptr(), num_slots, slot_bytes,
                         loopback)
        self.endpoint = "nixl:" + base64.b64encode(msgspec.msgpack.encode(info)).decode()
        self._senders: set[str] = set()

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        out: list[bytes] = []
        while True:
            for sender, msgs in self.agent.get_new_notifs().items():
                for msg in msgs:
                    self._on_notif(sender, msg, out)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.0005)

    def _on_notif(self, sender: str, msg: bytes, out: list[bytes]) -> None:
        if msg[:1] == b"H":  # a sender introduces itself: credits go back to it
            if sender not in self._senders:
                self.agent.add_remote_agent(msg[1:])
                self._senders.add(sender)
            return
        if len(msg) != _HDR.size or msg[:1] != b"F":
            return
        _, slot, length = _HDR.unpack(msg)
        if slot >= self.num_slots or length > self.slot_bytes:
            return
        start = slot * self.slot_bytes
        out.append(self.staging[start:start + length].numpy().tobytes())
        if sender in self._senders:
            self.agent.send_notif(sender, _HDR.pack(b"C", slot, 0))

    def close(self) -> None:
        for sender in self._senders:
            self.agent.remove_remote_agent(sender)
        self.agent.deregister_memory(self._reg)


class NixlSender(Transport):
    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        if not endpoint.startswith("nixl:"):
            raise TransportClosed(f"not a NIXL endpoint: {endpoint[:40]!r}")
        info = msgspec.msgpack.decode(base64.b64decode(endpoint[5:]), type=_Endpoint)
        self.info, self.timeout_s = info, timeout_s
        self.name, self.agent = _agent("kv-send", info.loopback)
        self.peer = self.agent.add_remote_agent(info.metadata)
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        self.buffer = torch.zeros(info.num_slots * info.slot_bytes, dtype=torch.uint8)
        self._reg = self.agent.register_memory(self.buffer)
        self._free = list(range(info.num_slots))
        self.agent.send_notif(info.agent, b"H" + self.agent.get_agent_metadata())

    def _take_credits(self) -> None:
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                if len(msg) == _HDR.size and msg[:1] == b"C":
                    self._free.append(_HDR.unpack(msg)[1])

    def send(self, frame: bytes) -> None:
        info = self.info
        if len(frame) > info.slot_bytes:
            raise TransportClosed(f"a {len(frame)}-byte frame does not fit a {info.slot_bytes}-byte NIXL slot")
        deadline = time.monotonic() + self.timeout_s
        self._take_credits()
        while not self._free:
            if time.monotonic() > deadline:
                raise TransportClosed("the NIXL receiver returned no slot in time (gone?)")
            time.sleep(0.0005)
            self._take_credits()
        slot = self._free.pop()
        start = slot * info.slot_bytes
        self.buffer[start:start + len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        local = self.agent.get_xfer_descs([(self.buffer.data_ptr() + start, len(frame), 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(info.address + start, len(frame), 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, info.agent, _HDR.pack(b"F", slot, len(frame)))
        try:
            if self.agent.transfer(handle) == "ERR":
                raise TransportClosed("NIXL transfer failed to post")
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TransportClosed("NIXL transfer did not complete in time")
                time.sleep(0.0002)
            if state != "DONE":
                raise TransportClosed(f"NIXL transfer ended {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def recv(self, timeout: float = 0.0) -> list[bytes]:
        raise NotImplementedError("a NIXL sender only sends")

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.info.agent)
        finally:
            self.agent.deregister_memory(self._reg)
