"""Parallel artifacts of tiny random HF checkpoints: `compile_parallel(arch, "tp = 2", **checkpoint_kw)`."""
from __future__ import annotations

import pytest

SERVE_LINE = "  serve     {"


def parallel_edit(mesh: str) -> tuple[str, str]:
    """The recipe edit that adds `parallel { mesh }` to a `kiln recipe from-hf` recipe."""
    return (SERVE_LINE, f"  parallel  {{ {mesh} }}\n{SERVE_LINE}")


@pytest.fixture(scope="session")
def compile_parallel(compile_hf):
    """`compile_parallel(arch, mesh, edits=(), **kw) -> (checkpoint, artifact)`; `mesh` None: the single-device
    artifact; `edits`: more recipe edits (compile_hf's)."""
    def build(arch: str, mesh: str | None, edits: tuple[tuple[str, str], ...] = (), **kw):
        ckpt, art, _ = compile_hf(arch, edits=((parallel_edit(mesh),) if mesh else ()) + tuple(edits), **kw)
        return ckpt, art

    return build


@pytest.fixture
def local_mesh(monkeypatch):
    """`kiln.LLM` runs a parallel artifact's ranks as threads of this process (the single-process mesh)."""
    monkeypatch.setenv("KILN_EXECUTOR", "local")
