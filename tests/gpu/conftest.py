"""tests/gpu runs only where CUDA is present, in its own pytest process (`pytest tests/gpu`).

Every test here is skipped without a CUDA device, and also when Triton's interpreter is on in this process
(tests/codegen/test_triton_kernels.py and scripts/test.sh turn it on; then kernels would not run on the GPU).
The skip happens in `pytest_runtest_setup`, before any fixture (rendering kernels, building checkpoints) runs.
Kernel autotuning is off here (KILN_AUTOTUNE=0 unless set): the tests check numerics with the rendered
defaults, and timing every candidate config for each of their many shapes would take minutes of compiles;
test_autotune_gpu.py turns it on for its own kernels module and checks every candidate config.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("KILN_AUTOTUNE", "0")


def pytest_runtest_setup(item):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run `python -m pytest tests/gpu` on its own")


@pytest.fixture(scope="session")
def render_triton_kernels(tmp_path_factory):
    """`render_triton_kernels(head_dim, num_heads, num_kv_heads, block_size)` -> the rendered Triton kernel
    library (bf16 render, with its CPU fallback library beside it), imported as a fresh package."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
    from codegen_helpers import render_kernels

    def render(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int):
        mod = render_kernels(tmp_path_factory.mktemp("gpu_kernels"), head_dim=head_dim, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, dtype="bfloat16", block_size=block_size)
        assert not mod.INTERPRET
        return mod

    return render


@pytest.fixture(scope="session")
def h200_graph_artifact(tiny_checkpoint, tmp_path_factory):
    """`h200_graph_artifact(name, edit=None)` -> an h200 artifact of the tiny Llama checkpoint in bf16 with decode
    CUDA graphs for batch sizes 1, 2, 4, 8; `edit(recipe_text) -> recipe_text` changes the recipe first."""
    import kiln
    from kiln.cli import main

    def build(name: str, edit=None):
        ckpt = tiny_checkpoint("llama")
        work = tmp_path_factory.mktemp(name)
        assert main(["recipe", "from-hf", str(ckpt), "-o", str(work / "r.dsl")]) == 0
        text = (work / "r.dsl").read_text().replace("dtype   = fp32", "dtype   = bf16")
        if edit is not None:
            text = edit(text)
        (work / "g.dsl").write_text(
            text.replace("  serve ", "  cuda_graphs { batch_sizes = [1, 2, 4, 8] }\n  serve ", 1))
        kiln.compile(work / "g.dsl", work / "h200", target="h200", progress=False)
        return work / "h200"

    return build
