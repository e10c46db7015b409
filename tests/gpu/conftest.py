"""tests/gpu runs only where CUDA is present, in its own pytest process (`pytest tests/gpu`).

Every test here is skipped without a CUDA device, and also when Triton's interpreter is on in this process
(tests/codegen/test_triton_kernels.py and scripts/test.sh turn it on; then kernels would not run on the GPU).
The skip happens in `pytest_runtest_setup`, before any fixture (rendering kernels, building checkpoints) runs.
"""
from __future__ import annotations

import os

import pytest
import torch


def pytest_runtest_setup(item):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run `python -m pytest tests/gpu` on its own")
