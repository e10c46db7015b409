"""A stand-in `python3` first on PATH, for running the scripts without touching a real interpreter."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def standin_python3(tmp_path: Path) -> Callable[[str], Path]:
    """`standin_python3(script)` writes `script` as an executable `python3`; returns its directory for PATH."""
    def make(script: str) -> Path:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        exe = bin_dir / "python3"
        exe.write_text(script)
        exe.chmod(0o755)
        return bin_dir
    return make
