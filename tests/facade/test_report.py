"""`kiln compile --report` on a Llama-3-8B-shaped recipe for h200: figures checked by hand.

Llama-3-8B: vocab 128256, hidden 4096, 32 layers, 32 heads, 8 KV heads (head_dim 128), ffn 14336, untied.
  per layer: q 4096*4096 + k,v 2*(1024*4096) + o 4096*4096 + gate/up/down 3*(14336*4096) + 2 norms*4096
           = 16,777,216*2 + 4,194,304*2 + 58,720,256*3 + 8,192 = 218,112,000
  total    = 32*218,112,000 + 2*(128256*4096) + 4096 = 8,030,261,248 params -> 16,060,522,496 B in bf16
  KV/token = 32 layers * 8 kv_heads * 128 head_dim * 2 (K,V) * 2 B = 131,072 B
  KV pool  = 0.90 * 141e9 B (H200) - 16,060,522,496 = 110,839,477,504 B -> 845,638 tokens
  TPOT floor at batch 1 = 16,060,522,496 B / 4.8e12 B/s = 3.346 ms
  compute-bound from B = 989e12 FLOP/s / 4.8e12 B/s * (2 B/param) / (2 FLOP/param) = 206
"""
from __future__ import annotations

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
    assert "845,638" in out
    assert "3.346 ms" in out
    assert "~206" in out


def test_report_fp8_kv_cache_halves_kv_bytes(tmp_path, capsys):
    p = tmp_path / "llama3_8b.dsl"
    p.write_text(RECIPE.replace("kv_cache {", "quantize { kv_cache = fp8 }\n  kv_cache {"))
    assert main(["compile", str(p), "--report"]) == 0
    out = capsys.readouterr().out
    assert "65,536 B" in out  # 32 * 8 * 128 * 2 * 1 B
