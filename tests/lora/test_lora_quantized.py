"""LoRA adapters over quantized base weights (fp8 per channel, int4 AWQ and GPTQ) against HF peft over the
float model those quantized weights dequantize to: the low-rank branch reads the quantized GEMM's input and
adds to its output, so kiln with the adapter equals PeftModel on the dequantized checkpoint (fp32, 1e-4), and
greedy tokens are identical. The reference checkpoints are built by tests/quant's independent quantizers."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from lora_testlib import ATTENTION_MLP, lora_recipe, peft_greedy, peft_logits

import kiln

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "quant"))
from quant_testlib import (  # noqa: E402
    fp8_reference,
    int4_dequant_reference,
    pack_awq,
    pack_gptq_cols,
    pack_gptq_rows,
    rewrite_checkpoint,
    rtn_int4,
)

GROUP = 32
PROMPT = [5, 17, 33, 101, 7, 250, 9, 11, 400, 3, 77, 12, 13, 14, 15, 16, 300, 301, 2, 9]
SERVE_LINE = "  serve     {"


def _linears(tensors):
    return [n for n in tensors if n.endswith("_proj.weight") and n.split(".")[-2] in ATTENTION_MLP]


def _checkpoints(base: pathlib.Path, root: pathlib.Path, scheme: str) -> tuple[pathlib.Path, pathlib.Path]:
    """(checkpoint kiln compiles, float checkpoint of the same dequantized weights for HF)."""
    deq: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(5)

    def pack(tensors):
        out = dict(tensors)
        for name in _linears(tensors):
            w, stem = tensors[name], name[: -len(".weight")]
            if scheme == "fp8":  # kiln quantizes at compile time; its e4m3 grid holds these values exactly
                q, s = fp8_reference(w, "channel")
                deq[name] = out[name] = q.float() * s
                continue
            g_idx = torch.randperm(w.shape[1], generator=gen) // GROUP if scheme == "gptq" else None
            q, z, s, g_idx = rtn_int4(w, GROUP, sym=scheme == "gptq", g_idx=g_idx)
            deq[name] = int4_dequant_reference(q, z, s, g_idx)
            del out[name]
            if scheme == "awq":
                out.update({f"{stem}.qweight": pack_awq(q), f"{stem}.qzeros": pack_awq(z), f"{stem}.scales": s})
            else:
                out.update({f"{stem}.qweight": pack_gptq_rows(q), f"{stem}.qzeros": pack_gptq_cols(z - 1),
                            f"{stem}.scales": s, f"{stem}.g_idx": g_idx.to(torch.int32)})
        return out

    packed = rewrite_checkpoint(base, root / f"ckpt-{scheme}", pack)
    reference = rewrite_checkpoint(base, root / f"ckpt-{scheme}-deq", lambda t: {**t, **deq})
    return packed, reference


@pytest.mark.parametrize("scheme,recipe", [("fp8", "fp8(per_channel=true)"), ("awq", f"awq(group={GROUP})"),
                                           ("gptq", f"gptq(group={GROUP})")])
def test_adapter_over_quantized_base_matches_peft(scheme, recipe, adapter, tiny_checkpoint, tiny_checkpoint_lib,
                                                  tmp_path):
    from kiln.cli import main

    packed, reference = _checkpoints(tiny_checkpoint("llama"), tmp_path, scheme)
    path = adapter(ATTENTION_MLP, seed=4)
    recipe_file = tmp_path / "recipe.dsl"
    assert main(["recipe", "from-hf", str(packed), "-o", str(recipe_file)]) == 0
    text = recipe_file.read_text().replace(SERVE_LINE, f"  quantize  {{ weights = {recipe} }}\n{SERVE_LINE}", 1)
    recipe_file.write_text(lora_recipe(text, f'max_loras = 1; max_rank = 8; adapters = {{ ad: "hf:{path}" }}'))
    kiln.compile(recipe_file, tmp_path / "art", progress=False)

    llm = kiln.LLM(str(tmp_path / "art"))
    params = kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=20)
    out = llm.generate([PROMPT], params, lora="ad")[0]
    load = tiny_checkpoint_lib.load_hf_model
    ref = peft_logits(reference, path, PROMPT, load).log_softmax(-1)
    assert (ref - peft_logits(reference, None, PROMPT, load).log_softmax(-1)).abs().max() > 0.05
    for j in range(1, len(PROMPT)):
        got = out.prompt_logprobs[j]
        ids = torch.tensor(list(got))
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.values()]), ref[j - 1, ids], atol=1e-4,
                                   rtol=0)
    assert out.outputs[0].token_ids == peft_greedy(reference, path, PROMPT, 8, load)
    base = llm.generate([PROMPT], params)[0]  # no adapter: the quantized base alone
    assert base.outputs[0].token_ids != out.outputs[0].token_ids or any(
        abs(base.prompt_logprobs[j][t].logprob - out.prompt_logprobs[j][t].logprob) > 1e-3
        for j, t in enumerate(PROMPT) if j > 0)
