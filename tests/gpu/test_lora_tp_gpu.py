"""LoRA on a tensor-parallel mesh on one GPU: an h200 bf16 tiny llama with two adapters (ranks 8 and 4) compiled
for tp = 2, both ranks in this process on cuda:0 (LocalMeshExecutor), each running the Triton segmented lora
kernel over its slice of the slots (a column-parallel branch's rows of each module), against the single-device
h200 artifact with the same adapters. bf16 both sides: prompt logprobs within 0.1, greedy tokens identical up to
the first near-tie (tests/gpu/test_parallel_mesh_gpu.py's assert_bf16_parity)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))
from lora_testlib import ATTENTION_MLP, make_adapter  # noqa: E402
from test_parallel_mesh_gpu import assert_bf16_parity  # noqa: E402

LORAS = ["a", "b", None]


@pytest.fixture(scope="module")
def build(tiny_checkpoint, tiny_checkpoint_lib, tmp_path_factory):
    pytest.importorskip("peft")
    ckpt = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("gpu_lora_tp")
    adapters = {"a": make_adapter(tiny_checkpoint_lib.load_hf_model(ckpt), root / "a", targets=ATTENTION_MLP, seed=1),
                "b": make_adapter(tiny_checkpoint_lib.load_hf_model(ckpt), root / "b",
                                  targets=["q_proj", "v_proj", "down_proj"], rank=4, seed=2)}
    entries = ("max_loras = 2; max_rank = 8; adapters = { " + ", ".join(f'{k}: "hf:{v}"' for k, v in adapters.items())
               + " }")

    def make(mesh: str | None) -> Path:
        work = root / (mesh or "single").replace(" ", "").replace("=", "")
        work.mkdir()
        assert main(["recipe", "from-hf", str(ckpt), "-o", str(work / "r.dsl")]) == 0
        text = (work / "r.dsl").read_text().replace("dtype   = fp32", "dtype   = bf16")
        sections = (f"  parallel  {{ {mesh} }}\n" if mesh else "") + f"  lora {{ {entries} }}\n"
        (work / "r.dsl").write_text(text.replace("  serve     {", sections + "  serve     {", 1))
        kiln.compile(work / "r.dsl", work / "art", target="h200", progress=False)
        return work / "art"

    return make


def test_tp2_with_adapters_on_one_gpu_equals_the_single_device(build, monkeypatch):
    single, placed = build(None), build("tp = 2")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 40, 17)]
    params = kiln.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    ref = kiln.LLM(str(single), device="cuda").generate(prompts, params, lora=LORAS)
    monkeypatch.setenv("KILN_EXECUTOR", "local")
    with kiln.LLM(str(placed), device="cuda") as llm:
        got = llm.generate(prompts, params, lora=LORAS)
    assert_bf16_parity(prompts, got, ref, "llama tp = 2 with adapters")
