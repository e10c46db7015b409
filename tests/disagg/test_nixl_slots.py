"""A NIXL receiver's slots hold the largest frame of a transfer: the `Done` frame of a long prompt with small
blocks (one 16-byte digest per block) is larger than a block frame; it used to be refused by the sender ("does
not fit a NIXL slot") and the transfer failed."""
from __future__ import annotations

import time

from kiln.runtime.disagg.plugins import connect, make_receiver
from kiln.runtime.disagg.transport import DoneFrame, block_digest, decode, encode


def test_done_frame_of_a_long_transfer_fits():
    receiver = make_receiver("nixl", 2048, max_blocks=257)  # the stand-in artifact's layout: 2 KiB a block
    sender = connect(receiver.endpoint)
    try:
        digests = [block_digest("t", i, 1, b"x") for i in range(257)]
        frame = encode(DoneFrame("t", digests))
        assert len(frame) > 2048 + 1024  # larger than a block frame's slot
        sender.send(frame)
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = receiver.recv(0.05)
        assert [decode(g) for g in got] == [DoneFrame("t", digests)]
    finally:
        sender.close()
        receiver.close()
