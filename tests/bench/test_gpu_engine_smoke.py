"""benchmarks/gpu_engine.py --cpu-smoke: the engine benchmark's code path (in-memory artifact from a compiled
recipe, LLMEngine steady decode, profiler breakdown, memory plan against the load) runs on the cpu target with a
tiny model, so the script is not first executed on an H200. Timings mean nothing; the JSON must be complete and
agree with the model's shapes, computed here from its config."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_engine.py"


@pytest.fixture(scope="module")
def gpu_engine():
    spec = importlib.util.spec_from_file_location("kiln_bench_gpu_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_cpu_smoke_measures_steady_decode_and_the_memory_plan(gpu_engine, tmp_path, capsys):
    assert gpu_engine.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    r = result["models"]["tiny"]
    assert "error" not in r, r
    cfg = gpu_engine.SMOKE_MODELS["tiny"]
    v, h, n_layers, ffn = cfg["vocab"], cfg["hidden"], cfg["layers"], cfg["ffn"]
    head_dim = h // cfg["heads"]
    kv_dim = cfg["kv_heads"] * head_dim
    # embed + lm_head + per layer (q, k, v, o, gate, up, down, two norms) + final norm, fp32
    params = 2 * v * h + n_layers * (h * h + 2 * kv_dim * h + h * h + 3 * h * ffn + 2 * h) + h
    assert r["predicted"]["weights_bytes"] == r["measured"]["weights_bytes"] == 4 * params
    kv_per_token = n_layers * 2 * kv_dim * 4
    assert r["predicted"]["kv_bytes_per_token"] == kv_per_token
    m = r["measured"]
    assert m["kv_tokens"] == m["kv_blocks"] * gpu_engine.BLOCK and m["kv_bytes"] == m["kv_tokens"] * kv_per_token
    assert r["fuse_rope_kv_write_matches"] == 1 and r["cuda_graphs"] is False
    # a decode step reads every matrix but the (untied) embedding table, and the KV of its context
    assert m["step_weight_bytes"] == 4 * (params - v * h - (2 * n_layers + 1) * h)
    rows = r["decode"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["batch"] / row["step_s"])
        context = 12 + 1 + 3 // 2  # prompt, warmup steps, half the timed steps (the --cpu-smoke setup)
        need = m["step_weight_bytes"] + row["batch"] * context * kv_per_token
        assert row["limit_s"] == pytest.approx(need / m["stream_bandwidth"])
        assert row["ratio"] == pytest.approx(row["limit_s"] / row["step_s"])
        assert row["profiled_steps"] == 2 and row["gpu_busy"] is None  # no GPU: busy is not defined
    top = rows[0]["top_kernels"]
    assert 0 < len(top) <= gpu_engine.TOP_KERNELS and "top_kernels" not in rows[1]
    assert [k["us_per_step"] for k in top] == sorted((k["us_per_step"] for k in top), reverse=True)
    printed = capsys.readouterr().out
    assert "memory plan" in printed and "KV tokens" in printed


def test_union_of_kernel_intervals(gpu_engine):
    """GPU busy counts overlapping kernels (two streams) once and the gaps between them not at all."""
    assert gpu_engine._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 12 + 5
    assert gpu_engine._union_us([]) == 0
