"""benchmarks/gpu_deepseek_layer.py --cpu-smoke: the DeepSeek-V3 layer benchmark's code path (one-layer recipe
compiled with MLA absorption and fused MoE, the block method timed alone, routing read off the MoE kernel's
input, bytes limit at the GEMV-loop bandwidth) on the cpu target with tiny shapes. Timings mean nothing; the
bytes accounting is checked against the shapes, computed here."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_deepseek_layer.py"


@pytest.fixture(scope="module")
def ds():
    spec = importlib.util.spec_from_file_location("kiln_bench_gpu_deepseek_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_cpu_smoke_accounts_the_bytes_a_decode_step_reads(ds, tmp_path, capsys):
    assert ds.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gpu_deepseek_layer.json").read_text())["layer"]
    assert "error" not in r, r
    s = ds.SMOKE
    h, heads, ql, kl = s["hidden"], s["heads"], s["q_lora_rank"], s["kv_lora_rank"]
    dn, dr, dv, f = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"], s["moe_ffn"]
    experts = r["experts"]
    attn = (h + ql * h + ql + heads * (dn + dr) * ql + (kl + dr) * h + kl + heads * (dn + dv) * kl
            + h * heads * dv + h + experts * h + experts)  # norms, q/kv projections, o, mlp norm, router + bias
    per_expert = 3 * f * h
    assert r["weight_bytes"] == {"attention_norms_router": 2 * attn, "shared": 2 * per_expert * s["shared_experts"],
                                 "routed": 2 * per_expert * experts, "per_expert": 2 * per_expert}
    assert {"cpu.mla_attention", "cpu.moe_experts", "cpu.moe_topk_grouped"} <= set(r["kernels"])
    assert [row["batch"] for row in r["decode"]] == [1, 3]
    for row in r["decode"]:
        b = row["batch"]
        assert s["top_k"] <= row["distinct_experts"] <= min(experts, b * s["top_k"])
        kv = b * r["context"] * (kl + dr) * 2
        assert row["kv_bytes"] == kv
        assert row["bytes_needed"] == 2 * attn + 2 * per_expert * (s["shared_experts"] + row["distinct_experts"]) + kv
        assert row["limit_s"] == pytest.approx(row["bytes_needed"] / r["stream_bandwidth"])
        assert row["timing"] == "eager" and row["graph_s"] is None  # no CUDA graphs on CPU
        assert row["ratio"] == pytest.approx(row["limit_s"] / row["eager_s"])
    assert "of limit" in capsys.readouterr().out
