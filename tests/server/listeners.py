"""The TCP sockets a process listens on, read from /proc (Linux): issue 29 item 7's check that every listener of a
one-machine deployment binds loopback."""
from __future__ import annotations

import os
from pathlib import Path

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address in /proc/net hex, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                addr, port = fields[1].split(":")
                found.append((addr, int(port, 16)))
    return found
