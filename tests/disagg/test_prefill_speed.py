"""Conditional disaggregation's measured prefill speed (runtime/disagg/service.py): the decode core's prefill
speed comes from a short local prompt's compute time, not from its time to first token, which also holds the time
it waited in the decode core's queue (a busy core would otherwise look slow and keep prompts remote)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from kiln.runtime.disagg import service
from kiln.runtime.disagg.service import DisaggAsyncEngine
from kiln.runtime.ipc.protocol import SeqDelta


class _Histogram:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, seconds: float) -> None:
        self.seen.append(seconds)


def _router() -> DisaggAsyncEngine:
    router = DisaggAsyncEngine.__new__(DisaggAsyncEngine)  # the timing bookkeeping only: no cores
    router._first_token, router.local_prefill_tps = {}, None
    router.ttft = {"remote": _Histogram(), "local": _Histogram()}
    return router


def test_prefill_speed_is_measured_from_compute_time_not_queueing(monkeypatch):
    router = _router()
    router._first_token["a"] = ["local:short_prompt", 100.0, 50, None, 0.0]  # added at t=100, 50 uncached tokens
    router._note_queued([("a", 0.9), ("unknown", 3.0)])  # it waited 0.9 s in the decode core's queue
    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: 101.0))
    router._first_tokens([SeqDelta("a", 0, [7])])  # its first token 1 s after it was added
    assert router.local_prefill_tps == pytest.approx(50 / 0.1)  # 50 tokens in 0.1 s of compute, not in 1 s
    assert router.ttft["local"].seen == [pytest.approx(1.0)]  # the TTFT histogram keeps the whole wait
    assert not router._first_token


def test_a_remote_prefill_does_not_measure_the_decode_core(monkeypatch):
    router = _router()
    router._first_token["b"] = ["remote", 10.0, 80, None, 0.0]
    router._note_queued([("b", 0.5)])
    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: 12.0))
    router._first_tokens([SeqDelta("b", 0, [7])])
    assert router.local_prefill_tps is None and router.ttft["remote"].seen == [pytest.approx(2.0)]
