"""benchmarks/gpu_lora.py --cpu-smoke: the LoRA kernel benchmark's code path (the rendered triton `lora` and the
torch one on the same segmented batch) under Triton's interpreter with tiny shapes. Timings mean nothing; the
bytes accounting is checked against the shapes, computed here."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_lora.py"


def test_cpu_smoke_accounts_the_bytes_each_case_reads(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("kiln_bench_gpu_lora", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        assert bench.main(["--cpu-smoke", "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    report = json.loads((tmp_path / "gpu_lora.json").read_text())
    k, rows = bench.SMOKE["k"], bench.SMOKE["rows"]
    got = [(r["case"], r["tokens"], r["adapters"]) for r in report["results"]]
    assert got == bench.SMOKE_CASES
    for r in report["results"]:
        rank, n = r["rank"], r["tokens"]
        want = r["adapters"] * (3 * rank * k + sum(rows) * rank) * 4 + n * k * 4 + 2 * n * sum(rows) * 4
        assert r["bytes"] == want and r["triton_us"] > 0 and r["torch_us"] > 0
    assert "speedup" in capsys.readouterr().out
