"""Percentiles, summaries, workloads and goodput accounting on fixed inputs (no server)."""
from __future__ import annotations

import math

import pytest

from kiln.bench import RequestResult, arrival_offsets, build_report, make_requests, parse_goodput, percentile


def test_percentiles_hand_computed():
    # Sorted: 15 20 35 40 50 (n = 5). Rank of q = q/100 * 4, interpolated between neighbours.
    values = [50.0, 15.0, 40.0, 20.0, 35.0]
    assert percentile(values, 0) == 15.0
    assert percentile(values, 25) == 20.0  # rank 1
    assert percentile(values, 50) == 35.0  # rank 2
    assert percentile(values, 75) == 40.0  # rank 3
    assert percentile(values, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * (50 - 40)
    assert percentile(values, 99) == pytest.approx(49.6)  # rank 3.96
    assert percentile(values, 100) == 50.0
    # Ten values 1..10: p50 at rank 4.5 is 5.5, p90 at rank 8.1 is 9.1.
    assert percentile(list(range(1, 11)), 50) == pytest.approx(5.5)
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def _result(ttft_ms: float, e2e_ms: float, out: int) -> RequestResult:
    return RequestResult(ok=True, input_len=10, output_len=out, ttft=ttft_ms / 1e3, e2e=e2e_ms / 1e3,
                         itl=[(e2e_ms - ttft_ms) / 1e3 / (out - 1)] * (out - 1))


def test_report_and_goodput_on_fixed_results():
    # TPOTs: (100-20)/4 = 20 ms, (300-100)/4 = 50 ms, (90-50)/4 = 10 ms.
    results = [_result(20, 100, 5), _result(100, 300, 5), _result(50, 90, 5),
               RequestResult(ok=False, input_len=10, error="HTTP 503")]
    report = build_report(results, duration=2.0, slos={"ttft": 60, "tpot": 25}, config={})
    assert report["completed"] == 3 and report["failed"] == 1 and report["errors"] == ["HTTP 503"]
    assert report["request_throughput"] == pytest.approx(1.5)
    assert report["output_token_throughput"] == pytest.approx(7.5)
    assert report["good_requests"] == 2 and report["goodput"] == pytest.approx(1.0)  # the 2nd misses both
    assert report["ttft_ms"]["p50"] == pytest.approx(50) and report["ttft_ms"]["mean"] == pytest.approx(170 / 3)
    assert report["tpot_ms"]["p50"] == pytest.approx(20) and report["e2e_ms"]["p90"] == pytest.approx(260)
    assert report["itl_ms"]["count"] == 12
    assert build_report(results, 2.0, {}, {})["goodput"] == report["request_throughput"]
    assert build_report(results, 2.0, {"ttft": 0}, {})["goodput"] == 0


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:30", "e2e:2000"]) == {"ttft": 500.0, "tpot": 30.0, "e2e": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_workloads_are_seeded_and_shaped():
    a = make_requests(50, input_len=16, output_len=8, vocab_size=300, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in make_requests(50, input_len=16, output_len=8,
                                                                      vocab_size=300, seed=3)]
    assert all(r.input_len == 16 and r.output_len == 8 and all(8 <= t < 300 for t in r.prompt) for r in a)
    shared = make_requests(6, input_len=4, output_len=2, shared_prefix_len=32, num_prefixes=2, seed=0)
    assert shared[0].prompt[:32] == shared[2].prompt[:32] != shared[1].prompt[:32]
    assert all(r.input_len == 36 for r in shared)
    sg = make_requests(400, input_len=64, output_len=32, dataset="sharegpt-like", max_model_len=256, seed=1)
    ins = sorted(r.input_len for r in sg)
    assert len(set(ins)) > 50 and 40 < ins[200] < 100  # spread out, median near 64
    assert all(r.input_len + r.output_len < 256 for r in sg)


def test_poisson_arrivals():
    offsets = arrival_offsets(2000, 10.0, seed=0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert 180 < offsets[-1] < 220  # 2000 arrivals at 10/s take ~200 s
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
