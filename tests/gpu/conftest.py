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
    import importlib
    import itertools
    import sys

    from kiln.codegen.render import template_env

    ids = itertools.count()

    def render(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int):
        root = tmp_path_factory.mktemp("gpu_kernels")
        pkg = root / f"gpukpkg{next(ids)}"
        pkg.mkdir()
        env = template_env()
        (pkg / "__init__.py").write_text("")
        (pkg / "cpu.py").write_text(env.get_template("cpu/kernels.py.j2").render(kiln_version="test"))
        (pkg / "triton.py").write_text(env.get_template("triton/kernels.py.j2").render(
            kiln_version="test", head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            dtype="bfloat16", block_size=block_size))
        sys.path.insert(0, str(root))
        try:
            mod = importlib.import_module(f"{pkg.name}.triton")
        finally:
            sys.path.remove(str(root))
        assert not mod.INTERPRET
        return mod

    return render
