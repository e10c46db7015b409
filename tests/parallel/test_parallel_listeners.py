"""Issue 29 item 7: every listener of a one-machine tp = 2 engine binds loopback (the rendezvous TCPStore of the
rank-0 core listened on every interface, IPv4 and IPv6)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from listeners import LOOPBACK, listening_sockets


def test_a_tp2_engine_listens_on_loopback_only(compile_parallel):
    _, art = compile_parallel("llama", "tp = 2")
    with kiln.LLM(str(art), num_kv_blocks=64) as llm:
        pids = [os.getpid(), *llm.engine.runner.worker_pids]
        store_port = llm.engine.runner.store.port
        sockets = listening_sockets(pids)
        assert store_port in {port for _, port in sockets}, sockets  # the rendezvous store is seen
        assert all(addr in LOOPBACK for addr, _ in sockets), sockets
