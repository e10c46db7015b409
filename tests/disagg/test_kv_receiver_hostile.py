"""A decode core's KV receiver (ZmqTransport, tcp) under messages that are not frames of a transfer it leased:
garbage bytes, a message of several parts, a frame of an unknown type, frames for a transfer never leased, one
above the receiver's size bound. Each is dropped and counted by kind (DecodeRole.dropped), nothing fails, and a
real transfer over the same receiver afterwards commits with the co-located tokens."""
from __future__ import annotations

import random
import time

import msgspec
import zmq
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.disagg.transport import BlockFrame, DoneFrame, FailFrame, ZmqTransport, encode
from kiln.runtime.sampling_params import SamplingParams
from pair import Pair, run_colocated

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_hostile_frames_are_dropped_and_a_transfer_then_commits(artifact_dir):
    prefill, decode = (EngineCore(artifact_dir, num_kv_blocks=64) for _ in range(2))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, decode.limits.vocab_size) for _ in range(n)] for n in (17, 40)]
    ref = {f"r{i}": run_colocated(EngineCore(artifact_dir, num_kv_blocks=64), [p], GREEDY)["r0"][0]
           for i, p in enumerate(prompts)}
    block_bytes = 1 << 16  # the receiver's bound, above a block of the stand-in
    receiver = ZmqTransport.bind(max_frame_bytes=block_bytes)
    sender = ZmqTransport(receiver.endpoint, bind=False)
    pair = Pair(prefill, decode, sender, receiver)
    role = pair.decode_role
    assert role.layout.block_bytes + 1024 < block_bytes
    ctx = zmq.Context.instance()
    attackers = [ctx.socket(zmq.PUSH) for _ in range(2)]
    try:
        for sock in attackers:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(receiver.endpoint)
        attackers[0].send(b"\x00" * (4 * block_bytes))  # above the bound: its connection is closed, unread
        time.sleep(0.2)
        evil = attackers[1]
        evil.send(b"\xc1 not msgpack at all")
        evil.send_multipart([b"one", b"two", b"three"])
        evil.send(msgspec.msgpack.encode({"type": "steal", "transfer_id": "x0"}))
        evil.send(encode(DoneFrame("nobody", [b"\0" * 16])))
        evil.send(encode(FailFrame("nobody", "forged")))
        evil.send(encode(BlockFrame("nobody", 0, 1, 0, b"\0" * 16, b"\0" * role.layout.block_bytes)))
        want = {"decode": 2, "frames": 1, "unknown": 3}
        deadline = time.monotonic() + 10
        while role.dropped.counts != want and time.monotonic() < deadline:
            role.poll(0.05)
        time.sleep(0.2)
        role.poll(0.05)
        assert role.dropped.counts == want
        assert role.num_bad_frames == 5  # every one but the message of several parts, dropped before it is a frame
        assert role.ledger.counts.get("failed", 0) == 0 and not role.pending
        out = pair.run(prompts, GREEDY)
        deadline = time.monotonic() + 10
        while role.pending and time.monotonic() < deadline:
            role.poll(0.05)
        assert {r: v[0] for r, v in out.items()} == ref
        assert role.ledger.counts["succeeded"] == len(prompts) and role.ledger.counts.get("failed", 0) == 0
        assert role.decisions["remote"] == len(prompts)
        assert role.dropped.counts == want  # the real transfer's frames were all taken
    finally:
        for sock in attackers:
            sock.close(0)
        sender.close()
        receiver.close()
