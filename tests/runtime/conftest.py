"""Fixtures over the stand-in artifact (see standin_artifact.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from standin_artifact import write_artifact


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tmp_path_factory.mktemp("art") / "standin")


@pytest.fixture
def artifact_copy(artifact_dir: Path, tmp_path: Path):
    """A private copy whose manifest a test may edit: `artifact_copy(lambda m: ...)` -> path."""
    def make(edit=None) -> Path:
        dst = tmp_path / "art"
        shutil.copytree(artifact_dir, dst)
        if edit is not None:
            manifest = json.loads((dst / "manifest.json").read_text())
            edit(manifest)
            (dst / "manifest.json").write_text(json.dumps(manifest))
        return dst
    return make


@pytest.fixture(scope="session")
def standin_weights(artifact_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(artifact_dir / "weights" / "rank0" / "model.safetensors"))
