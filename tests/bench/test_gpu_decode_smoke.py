"""benchmarks/gpu_decode.py --cpu-smoke: the GPU benchmark's code path (bf16 and quantized executors, random
quantized weights in the executor's layout, fp8-KV capacity through the runtime's sizing) runs on CPU under
Triton's interpreter, so the script is not first executed on an H200. Its timings mean nothing; what it
produces must be complete and self-consistent."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

# numpy deprecations inside the interpreter; non-finite values would be a bug (they came from token ids past the
# tiny model's vocabulary, gathered out of bounds by the interpreted embedding kernel)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("error:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_decode.py"


@pytest.fixture(scope="module")
def gpu_decode():
    spec = importlib.util.spec_from_file_location("kiln_bench_gpu_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_cpu_smoke_runs_every_variant(gpu_decode, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_decode.main(["--cpu-smoke", "--out", str(tmp_path), "--quant", "fp8,fp8_dynamic,int4",
                            "--quant-budget-s", "600"]) == 0
    result = json.loads((tmp_path / "gpu_decode.json").read_text())
    base = result["models"]["tiny"]
    assert [r["batch"] for r in base["decode"]] == [1, 2] and base["prefill"]["tokens"] == 16
    quant = result["quantized"]
    kernels = {"fp8": ["triton.linear_fp8"], "fp8_dynamic": ["triton.linear_fp8"], "int4": ["triton.linear_w4a16"]}
    for q, want in kernels.items():
        assert "error" not in quant[q], quant[q]
        assert quant[q]["linear_kernels"] == want  # every layer projection quantized; the LM head is `logits`
        assert [r["batch"] for r in quant[q]["decode"]] == [1, 2]
        assert all(r["speedup_vs_bf16"] > 0 and r["speedup_timing"] == "eager" for r in quant[q]["decode"])
    # bytes one step reads: int4 (0.5 B + group scales/zeros) < fp8 (1 B + row scales) < bf16 (2 B); the bf16
    # LM head (512 x 128) is read by all three
    head = 512 * 128 * 2
    b16, f8, i4 = (r["weight_bytes_read_per_step"] - head for r in (base, quant["fp8"], quant["int4"]))
    assert f8 == b16 // 2 + 4 * (128 + 64 + 64 + 128 + 256 + 256 + 128)  # + one f32 scale per output row
    assert b16 // 4 < i4 < f8
    cap = quant["kv_capacity"]
    # 1 layer x (K, V) x 1 KV head x head_dim 64, 2 B (bf16) or 1 B (fp8) per element
    assert cap["bf16"]["bytes_per_token"] == 2 * cap["fp8"]["bytes_per_token"] == 1 * 2 * 1 * 64 * 2
    assert cap["ratio"] == 2.0 and cap["fp8"]["tokens"] * 64 * 2 <= cap["budget_bytes"]


def test_unknown_quant_variant_is_refused(gpu_decode, tmp_path):
    with pytest.raises(SystemExit, match="unknown variant 'int3'"):
        gpu_decode._run_quantized(gpu_decode.Setup(torch.device("cpu"), smoke=True),
                                  type("A", (), {"quant": "int3"})(), {}, {"models": {}}, tmp_path)


def test_help(gpu_decode, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_decode.main(["--help"])
    assert e.value.code == 0 and "--cpu-smoke" in capsys.readouterr().out
