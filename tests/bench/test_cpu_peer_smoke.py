"""benchmarks/cpu_peer.py --tiny: the peer benchmark's whole kiln path (random checkpoint built with transformers,
`kiln recipe from-hf` + `kiln compile`, the weight-streaming loop, offline `LLM.generate`, `kiln serve` started,
loaded by kiln's client and killed) on a tiny model, one concurrency, four prompts, no vLLM. Timings mean nothing
here; the JSON must be complete, agree with the model's shapes (computed here from the shape table and the
embedded tokenizer's vocabulary) and the workload, and every figure must be positive."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "cpu_peer.py"


@pytest.fixture(scope="module")
def cpu_peer():
    spec = importlib.util.spec_from_file_location("kiln_bench_cpu_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            found.append(cmdline)
    return found


def test_tiny_run_writes_a_complete_positive_report(cpu_peer, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    mask = sorted(os.sched_getaffinity(0))
    # with two CPUs or more, as issue 11's measurement runs: the engines compute on one, the clients on another
    placed = ["--cores", f"{mask[0]},{mask[-1]}", "--compute-cores", str(mask[0]), "--client-cores", str(mask[-1])] \
        if len(mask) >= 2 else []
    assert cpu_peer.main(["--tiny", "--out-dir", str(out), "--work-dir", str(work), *placed]) == 0
    assert sorted(os.sched_getaffinity(0)) == mask  # this process got its cores back
    files = list(out.glob("cpu_peer-*.json"))
    assert len(files) == 1, files
    r = json.loads(files[0].read_text())
    assert r["workload"] == {"num_prompts": 4, "input_len": 16, "output_len": 8, "concurrency": [4], "rounds": 1,
                             "seed": 0, "kv_gib": 1 / 16, "dtype": "fp32"}
    assert r["host"]["lscpu_model"] and r["vllm_python"] is None and r["threads"]["vllm"] is None
    assert r["threads"]["kiln"]["OMP_NUM_THREADS"] == len(r["threads"]["compute_cores"]) >= 1
    if placed:
        assert r["threads"]["compute_cores"] == [mask[0]] and r["threads"]["client_cores"] == [mask[-1]]
        assert r["threads"]["kiln"]["core_cpus"] == [mask[0]]  # `kiln serve --core-cpus`

    m = r["checkpoints"]["tiny"]
    shape = cpu_peer.MODELS["tiny"]
    vocab = json.loads((REPO / "examples" / "embedded" / "config.json").read_text())["vocab_size"]
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q_dim = shape["num_attention_heads"] * shape["head_dim"]
    kv_dim = shape["num_key_value_heads"] * shape["head_dim"]
    matrices = vocab * h + layers * (2 * h * q_dim + 2 * h * kv_dim + 3 * h * ffn)  # tied: one vocab x h table
    assert m["params"] == matrices + (2 * layers + 1) * h  # + the RMSNorm weights
    # the streaming loop reads every matrix once (the tied table as the lm_head), fp32
    s = m["stream"]
    assert s["matrices"] == 7 * layers + 1 and s["weight_bytes"] == 4 * matrices
    assert 0 < s["pass_ms_best"] <= s["pass_ms_median"] and s["passes"] >= 10
    assert s["limit_tok_s_batch1"] == pytest.approx(1e3 / s["pass_ms_best"])
    assert s["bandwidth_gb_s_best"] == pytest.approx(s["weight_bytes"] / s["pass_ms_best"] / 1e6)
    assert s["torch_threads"] == r["threads"]["kiln"]["OMP_NUM_THREADS"]
    # --dtype bf16: the same loop's bandwidth over half the bytes
    b = cpu_peer.stream_worker(Path(m["checkpoint"]), 0.0, "bf16")
    assert b["dtype"] == "bf16" and b["weight_bytes"] == 2 * matrices == b["fp32_weight_bytes"] // 2
    assert b["pass_ms_best"] == pytest.approx(b["fp32_pass_ms_best"] / 2)
    assert b["limit_tok_s_batch1"] == pytest.approx(1e3 / b["pass_ms_best"])
    assert b["bandwidth_gb_s_best"] == pytest.approx(b["fp32_weight_bytes"] / b["fp32_pass_ms_best"] / 1e6)

    (row,) = m["offline"]["rows"]
    assert row["batch"] == 4 and row["prompts"] == 4 and row["output_tokens"] == 4 * 8  # ignore_eos: every token
    assert row["out_tok_s"] == pytest.approx(row["output_tokens"] / row["duration_s"]) and row["out_tok_s"] > 0

    served = m["served"]
    assert list(served) == ["kiln"] and list(served["kiln"]["clients"]) == ["kiln"]
    assert len(served["kiln"]["startup_s"]) == 1 and served["kiln"]["startup_s"][0] > 0
    (run,) = served["kiln"]["clients"]["kiln"]["4"]
    assert run["completed"] == 4 and run["failed"] == 0 and run["output_tokens"] == 4 * 8, run
    for key in ("out_tok_s", "tpot_p50_ms", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms", "duration_s"):
        assert run[key] > 0, key
    assert run["out_tok_s"] == pytest.approx(run["output_tokens"] / run["duration_s"])

    (summary,) = r["summary"]
    assert summary["checkpoint"] == "tiny" and summary["concurrency"] == 4 and summary["client"] == "kiln"
    assert summary["kiln_out_tok_s"] == [run["out_tok_s"]]
    assert summary["served_over_offline"] == pytest.approx(run["out_tok_s"] / row["out_tok_s"])
    assert summary["kiln_stream_share"] == pytest.approx(s["pass_ms_best"] / run["tpot_p50_ms"])
    assert "ratio" not in summary  # no vLLM, no ratio
    assert "| tiny (" in capsys.readouterr().out
    # the server's process group was killed: nothing runs from the work dir any more
    assert _processes_mentioning(str(work)) == []


def test_py_spy_stacks_are_aggregated_per_thread(cpu_peer):
    raw = ("thread (11): MainThread;run (asyncio/base_events.py:600);select (selectors.py:468) 6\n"
           "thread (12): kiln-engine;step (/x/kiln/runtime/core/engine.py:90);paged_attention (/a/kernels/cpu.py:40) 3\n"
           "thread (12): kiln-engine;step (/x/kiln/runtime/core/engine.py:90);linear (/a/kernels/cpu.py:10) 1\n"
           "garbage line without a count\n")
    s = cpu_peer.summarize_stacks(raw)
    assert s["tids"] == {11: "MainThread", 12: "kiln-engine"}
    engine = s["threads"]["thread (12): kiln-engine"]
    assert engine["samples"] == 4 and engine["share"] == pytest.approx(0.4)
    assert engine["inclusive"][0] == ["runtime/core/engine.py:step", 1.0]
    assert engine["self"] == [["/a/kernels/cpu.py:paged_attention", 0.75], ["/a/kernels/cpu.py:linear", 0.25]]
    assert s["threads"]["thread (11): MainThread"]["self"] == [["selectors.py:select", 1.0]]
