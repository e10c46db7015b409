"""An h200 artifact with adapters (its `lora` nodes on the Triton segmented kernel), run on CPU by Triton's
interpreter: a batch mixing two adapters and the base gives HF peft's log-probabilities within 1e-4 (fp32) and the
cpu artifact's greedy tokens, also with chunked prefill (an adapter's prompt over several steps, decodes of the
others in the same steps)."""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_testlib import ATTENTION_MLP, lora_recipe, peft_logits  # noqa: E402

import kiln  # noqa: E402

pytest.importorskip("triton")

PROMPTS = [[5, 17, 33, 101, 7, 250, 9, 11, 400, 3, 77, 12], [44, 45, 46, 200, 8], [9, 8, 7, 300, 301, 302, 2]]
NAMES = ["a", None, "b"]


def _no_fallback(*args, **kw):
    raise AssertionError("the triton lora kernel fell back to the torch one")


def test_h200_artifact_with_adapters_matches_peft_and_the_cpu_artifact(adapter, compile_lora, tiny_checkpoint,
                                                                       tiny_checkpoint_lib, tmp_path, monkeypatch):
    from kiln.cli import main

    paths = {"a": adapter(ATTENTION_MLP, seed=31), "b": adapter(["q_proj", "v_proj"], seed=32, rank=4)}
    section = "max_loras = 2; max_rank = 8"
    cpu = compile_lora(section, paths)
    recipe = tmp_path / "recipe.dsl"
    ckpt = tiny_checkpoint("llama")
    assert main(["recipe", "from-hf", str(ckpt), "-o", str(recipe)]) == 0
    entries = section + "; adapters = { " + ", ".join(f'{k}: "hf:{v}"' for k, v in paths.items()) + " }"
    recipe.write_text(lora_recipe(recipe.read_text(), entries))
    res = kiln.compile(recipe, tmp_path / "h200", target="h200", progress=False)
    assert "triton.lora" in res.manifest["kernels"]
    assert "def _lora_shrink_kernel(" in (tmp_path / "h200" / "kernels" / "triton.py").read_text()

    params = kiln.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    want = kiln.LLM(str(cpu)).generate(PROMPTS, params, lora=NAMES)
    # chunked prefill only (the interpreter is slow): every step then mixes an adapter's prompt chunk with the
    # others' decodes; whole-prompt segments of up to 98 rows are tests/codegen/test_triton_lora.py's
    for chunk in (4,):
        llm = kiln.LLM(str(tmp_path / "h200"), chunked_prefill=chunk)
        K = sys.modules[type(llm.engine.runner.model).__module__].K  # the artifact's triton kernels
        monkeypatch.setattr(K._ref, "lora", _no_fallback)
        got = llm.generate(PROMPTS, params, lora=NAMES)
        for prompt, name, g, w in zip(PROMPTS, NAMES, got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            ref = peft_logits(ckpt, paths[name] if name else None, prompt, tiny_checkpoint_lib.load_hf_model)
            ref = ref.log_softmax(-1)
            ours = torch.tensor([d[t].logprob for d, t in zip(g.prompt_logprobs[1:], prompt[1:])])
            torch.testing.assert_close(ours, ref[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-4, rtol=0)
