"""`kiln compile --report` on a Llama-3-8B-shaped recipe for h200: figures checked by hand.

Llama-3-8B: vocab 128256, hidden 4096, 32 layers, 32 heads, 8 KV heads (head_dim 128), ffn 14336, untied.
  per layer: q 4096*4096 + k,v 2*(1024*4096) + o 4096*4096 + gate/up/down 3*(14336*4096) + 2 norms*4096
           = 16,777,216*2 + 4,194,304*2 + 58,720,256*3 + 8,192 = 218,112,000
  total    = 32*218,112,000 + 2*(128256*4096) + 4096 = 8,030,261,248 params -> 16,060,522,496 B in bf16
  KV/token = 32 layers * 8 kv_heads * 128 head_dim * 2 (K,V) * 2 B = 131,072 B
  KV pool  = 0.90 * 141e9 B (H200) - 16,060,522,496 = 110,839,477,504 B before the activation peak and the
             CUDA-graph reserve, which the runtime subtracts too (test_gpu_report_predicts_the_runtime_formula)
  TPOT floor at batch 1 = 16,060,522,496 B / 4.8e12 B/s = 3.346 ms
  compute-bound from B = 989e12 FLOP/s / 4.8e12 B/s * (2 B/param) / (2 FLOP/param) = 206
"""
from __future__ import annotations

import pytest

import kiln
from kiln.cli import main

RECIPE = """
recipe llama3_8b_h200 {
  model    = llama(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0)
  weights  = random(seed=0)
  target   = h200
  dtype    = bf16
  kv_cache { block_size = 16; memory_fraction = 0.90 }
}
"""


def test_report_llama3_8b_h200(tmp_path, capsys):
    p = tmp_path / "llama3_8b.dsl"
    p.write_text(RECIPE)
    assert main(["compile", str(p), "--report"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out
    assert "16.06 GB" in out
    assert "131,072 B" in out
    assert "0.9 x 141.00 GB device memory" in out and "weights 16.06 GB" in out
    assert "3.346 ms" in out
    assert "~206" in out


def test_report_fp8_kv_cache_halves_kv_bytes(tmp_path, capsys):
    p = tmp_path / "llama3_8b.dsl"
    p.write_text(RECIPE.replace("kv_cache {", "quantize { kv_cache = fp8 }\n  kv_cache {"))
    assert main(["compile", str(p), "--report"]) == 0
    out = capsys.readouterr().out
    assert "65,536 B" in out  # 32 * 8 * 128 * 2 * 1 B


# ---------------------------------------------------------------- the report predicts the runtime (issue 10 item 18)

SMALL = """
recipe small {
  model   = llama(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_position=256)
  weights = random(seed=0)
  target  = TARGET
  kv_cache { block_size = 16 KV }
}
"""


def _report_tokens(report: str) -> int:
    line = next(ln for ln in report.splitlines() if ln.strip().startswith("KV tokens that fit"))
    return int(line.split()[-1].replace(",", ""))


@pytest.mark.parametrize("kv, blocks", [("", None), ("; num_blocks = 100", 100)])
def test_cpu_report_predicts_what_the_runtime_allocates(tmp_path, kv, blocks):
    """On the cpu target `kiln compile --report` states the pool `kiln serve` / kiln.LLM allocate: blocks and
    tokens, from the same decision recorded in the manifest (was: 23 GB / 3.7M tokens planned, 0.25 GiB
    allocated)."""
    from kiln.runtime.llm_engine import LLMEngine

    p = tmp_path / "small.dsl"
    p.write_text(SMALL.replace("TARGET", "cpu").replace(" KV", kv))
    res = kiln.compile(p, tmp_path / "art", progress=False)
    engine = LLMEngine(tmp_path / "art")
    allocated = engine.block_manager.num_blocks * engine.block_manager.block_size
    assert _report_tokens(res.report) == allocated
    assert engine.runner.memory_plan["kv_bytes"] == allocated * res.manifest["kv_cache"]["bytes_per_token"]
    if blocks is not None:
        assert engine.block_manager.num_blocks == blocks
    else:
        assert res.manifest["kv_cache"]["pool_bytes"] == 256 * 2**20 and "0.25 GiB" in res.report


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_gpu_report_predicts_the_runtime_formula(tmp_path, target):
    """On a GPU target the runtime sizes the pool at load (memory_plan.plan_kv_cache: fraction x device memory -
    weights - activation peak - CUDA-graph reserve); the report evaluates the same formula on the datasheet's
    memory, the manifest's graph reserve and the IR's activation estimate."""
    from kiln.compiler.report import kv_pool_plan
    from kiln.compiler.targets import get_target
    from kiln.runtime.worker.memory_plan import plan_kv_cache

    p = tmp_path / "small.dsl"
    p.write_text(SMALL.replace("TARGET", target).replace(" KV", "; memory_fraction = 0.5"))
    res = kiln.compile(p, tmp_path / "art", progress=False)
    m = res.manifest
    plan = kv_pool_plan(res.program, get_target(target))
    assert plan.source == "memory_fraction" and m["kv_cache"]["pool_bytes"] is None
    assert plan.parts["graph_reserve"] == m["cuda_graphs"]["estimated_bytes"] > 0
    assert plan.parts["weights"] == m["weights"]["total_bytes"]
    runtime = plan_kv_cache(bytes_per_block=m["kv_cache"]["bytes_per_token"] * m["kv_cache"]["block_size"],
                            total=get_target(target).memory_bytes, fraction=m["kv_cache"]["memory_fraction"],
                            weights=m["weights"]["total_bytes"], activation_peak=plan.parts["activation_peak"],
                            graph_reserve=m["cuda_graphs"]["estimated_bytes"])
    assert _report_tokens(res.report) == runtime["kv_blocks"] * 16 == plan.tokens
