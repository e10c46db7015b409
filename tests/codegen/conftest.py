"""Codegen test fixtures (helpers live in codegen_helpers.py, imported by the test modules)."""
from __future__ import annotations

from pathlib import Path

import pytest
from codegen_helpers import checkpoint_tensors, write_checkpoint


@pytest.fixture
def ckpt_factory(tmp_path):
    def make(name: str = "ckpt", *, layers: int = 2, tail_layers: int = 0, shards: int = 1, index: bool = True,
             tensors: dict | None = None, config: dict | None = None) -> Path:
        tensors = tensors if tensors is not None else checkpoint_tensors(layers, tail_layers)
        return write_checkpoint(tmp_path / name, tensors, shards=shards, index=index, config=config)
    return make
