"""kiln:prefill_decisions_total counts the requests a disaggregated server prefills on its decode core because its
prefill core is gone (the router decides those itself: the decode core is never asked)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
from live_server import MODEL, LiveServer, pid_alive


def test_requests_served_after_the_prefill_core_died_are_counted(standin_dir: Path):
    server = LiveServer(standin_dir, {"num_kv_blocks": 256}, disaggregate={"transport": "tcp",
                                                                          "remote_prefill": "always"})
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 2, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        pid = server.prefill_core.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.engine.prefill.is_running:
            assert time.monotonic() < deadline, "the router did not see its prefill core die"
            time.sleep(0.05)
        for _ in range(3):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(server.url + "/metrics").text
        assert 'kiln:prefill_decisions_total{decision="local:no_prefill_core"} 3.0' in text, text
        assert not pid_alive(pid)
    finally:
        server.stop()
