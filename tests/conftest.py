"""Shared fixtures: tiny random Hugging Face checkpoints, built offline once per test session."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load_examples_module(name: str):
    # examples/ is data, not a package: import the script by path
    spec = importlib.util.spec_from_file_location(f"kiln_examples_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint_lib():
    """The examples/make_tiny_checkpoint.py module (build_tiny_checkpoint, load_hf_model, ARCHS, ...)."""
    pytest.importorskip("transformers")
    return _load_examples_module("make_tiny_checkpoint")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_lib, tmp_path_factory) -> Callable[..., pathlib.Path]:
    """Factory `tiny_checkpoint(arch="llama", **kw) -> Path`; each distinct (arch, kw) is built once per session.

    kw are build_tiny_checkpoint's keywords: seed, num_shards, dtype, legacy_config, config overrides.
    Treat the returned directory as read-only: other tests share it.
    """
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    cache: dict[tuple, pathlib.Path] = {}

    def make(arch: str = "llama", **kw) -> pathlib.Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            out = root / f"{arch}-{len(cache)}"
            cache[key] = tiny_checkpoint_lib.build_tiny_checkpoint(out, arch, **kw)
        return cache[key]

    return make
