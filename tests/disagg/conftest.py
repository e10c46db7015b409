"""Fixtures: the stand-in artifact (tests/runtime/standin_artifact.py) and an in-process prefill/decode pair."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin_artifact import write_artifact


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tmp_path_factory.mktemp("disagg-art") / "standin")
