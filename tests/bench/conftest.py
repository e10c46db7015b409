"""Fixtures: a live server over the stand-in artifact, and one over a real compiled model (the embedded model
when its checkpoint exists, else a tiny random Llama checkpoint)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS / "runtime"))
sys.path.insert(0, str(TESTS / "server"))
from live_server import MODEL, LiveServer  # noqa: E402
from standin_artifact import write_artifact  # noqa: E402

EMBEDDED_CKPT = REPO / "examples" / "embedded"
EMBEDDED_RECIPE = REPO / "examples" / "embedded.dsl"


@pytest.fixture(scope="session")
def bench_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(write_artifact(tmp_path_factory.mktemp("bench-art") / MODEL), {"num_kv_blocks": 1024})
    yield server
    server.stop()


def embedded_available() -> bool:
    return EMBEDDED_RECIPE.exists() and (EMBEDDED_CKPT / "config.json").exists() and any(
        EMBEDDED_CKPT.glob("*.safetensors"))


@pytest.fixture(scope="session")
def model_artifact(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compiled artifact of a real model: the embedded one if it has landed, else a tiny random Llama."""
    import kiln
    from kiln.cli import main

    out = tmp_path_factory.mktemp("bench-model")
    if embedded_available():
        recipe = EMBEDDED_RECIPE
    else:
        recipe = out / "tiny.dsl"
        assert main(["recipe", "from-hf", str(tiny_checkpoint("llama")), "-o", str(recipe)]) == 0
    kiln.compile(str(recipe), out / "art", progress=False)
    return out / "art"
