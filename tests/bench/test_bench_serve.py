"""`kiln bench serve` / `sweep` against a live server on 127.0.0.1 (the stand-in artifact)."""
from __future__ import annotations

import asyncio
import json
import math

from live_server import MODEL
from standin_artifact import BLOCK_SIZE

from kiln.bench import make_requests, run_serve
from kiln.cli import main

VOCAB = 300  # the stand-in tokenizer has ~320 ids
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _serve(server, n: int = 8, **kw):
    requests = make_requests(n, input_len=12, output_len=5, vocab_size=VOCAB, seed=0)
    return asyncio.run(run_serve(server.url, requests=requests, **kw))


def test_serve_report_has_every_metric_and_counts_match(bench_server, tmp_path, capsys):
    bench_server.wait_idle()
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", bench_server.url, "--num-prompts", "10", "--input-len", "12",
                 "--output-len", "5", "--vocab-size", str(VOCAB), "--request-rate", "50", "--seed", "1",
                 "--goodput", "ttft:100000", "tpot:100000", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "request throughput"):
        assert word in printed
    report = json.loads(out.read_text())
    assert report["config"]["model"] == MODEL and report["config"]["request_rate"] == 50
    assert report["num_prompts"] == report["completed"] == 10 and report["failed"] == 0
    assert report["total_output_tokens"] == 10 * 5 and report["total_input_tokens"] == 10 * 12
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[metric]
        assert set(stats) == {"mean", "p50", "p90", "p99", "count"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert report["ttft_ms"]["count"] == report["e2e_ms"]["count"] == 10
    assert report["ttft_ms"]["p50"] < report["e2e_ms"]["p50"]
    assert report["request_throughput"] > 0 and report["output_token_throughput"] > 0
    # Every SLO is met: goodput is the request throughput.
    assert report["good_requests"] == 10 and report["goodput"] == report["request_throughput"]
    bench_server.wait_idle()


def test_goodput_is_zero_for_a_zero_slo_and_bounded_by_throughput(bench_server):
    zero = _serve(bench_server, goodput={"ttft": 0})
    assert zero["completed"] == 8 and zero["goodput"] == 0 and zero["good_requests"] == 0
    some = _serve(bench_server, max_concurrency=2, goodput={"tpot": 1e9, "e2e": 1e9})
    assert some["completed"] == 8 and some["config"]["max_concurrency"] == 2
    assert 0 < some["goodput"] <= some["request_throughput"]


def test_shared_prefix_workload_hits_the_prefix_cache(bench_server):
    bench_server.wait_idle()
    hits = bench_server.metric("kiln:prefix_cache_hits_total")
    requests = make_requests(6, input_len=4, output_len=3, shared_prefix_len=8 * BLOCK_SIZE, vocab_size=VOCAB,
                             seed=5)
    report = asyncio.run(run_serve(bench_server.url, requests=requests, max_concurrency=1))
    assert report["completed"] == 6
    # Requests 2..6 find the 8 shared blocks.
    assert bench_server.metric("kiln:prefix_cache_hits_total") - hits >= 5 * 8 * BLOCK_SIZE


def test_sweep_writes_png_and_json(bench_server, tmp_path, capsys):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    assert main(["bench", "sweep", "--base-url", bench_server.url, "--rates", "20,inf", "--num-prompts", "6",
                 "--input-len", "8", "--output-len", "4", "--vocab-size", str(VOCAB), "--goodput", "e2e:60000",
                 "--png", str(png), "--json", str(out)]) == 0
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 200
    reports = json.loads(out.read_text())
    assert [r["config"]["request_rate"] for r in reports] == [20, math.inf]
    assert all(r["completed"] == 6 and r["goodput"] <= r["request_throughput"] for r in reports)
    assert "goodput" in capsys.readouterr().out


def test_unreachable_server_reports_failures(tmp_path):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    report = asyncio.run(run_serve(f"http://127.0.0.1:{port}", model=MODEL, timeout=5,
                                   requests=make_requests(3, input_len=4, output_len=2, seed=0)))
    assert report["completed"] == 0 and report["failed"] == 3 and report["errors"]
    assert report["goodput"] == 0
