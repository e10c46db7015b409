"""A MoE checkpoint whose expert weights are stored in fp8 (Qwen3-MoE-FP8's and DeepSeek-V3's layout: e4m3
codes with `<name>_scale_inv` 128x128 block scales — 16x16 here, for the tiny model) compiles to the model
those codes times their scales give: quantize_weights leaves 3-D expert weights float, so the converter
dequantizes each expert's tensor before stacking them. HF parity against the dequantized checkpoint."""
from __future__ import annotations

import pathlib
import sys

import torch

import kiln

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "quant"))
from quant_testlib import rewrite_checkpoint  # noqa: E402

BLOCK = 16


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, [N/B, K/B] scales, the float weight they stand for), written from DeepSeek's layout."""
    n, k = w.shape
    s = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * full


def test_fp8_experts_match_hf_on_the_dequantized_checkpoint(tiny_checkpoint, check_hf_parity, tmp_path):
    from kiln.cli import main

    base = tiny_checkpoint("qwen3_moe")
    deq: dict[str, torch.Tensor] = {}

    def to_fp8(tensors):
        out = dict(tensors)
        for name, w in tensors.items():
            if ".experts." in name and name.endswith(".weight"):
                out[name], out[name + "_scale_inv"], deq[name] = _fp8_blocks(w)
        return out

    fp8 = rewrite_checkpoint(base, tmp_path / "fp8", to_fp8)
    reference = rewrite_checkpoint(base, tmp_path / "deq", lambda t: {**t, **deq})
    assert len(deq) >= 6
    recipe = tmp_path / "recipe.dsl"
    assert main(["recipe", "from-hf", str(fp8), "-o", str(recipe)]) == 0
    kiln.compile(recipe, tmp_path / "art", progress=False)
    check_hf_parity(tmp_path / "art", reference, vocab=512)
