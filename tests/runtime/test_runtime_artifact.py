"""Artifact loading: package import of the generated code, weights, manifest checks."""
from __future__ import annotations

import json

import pytest
import torch
from kiln.runtime import ArtifactError
from kiln.runtime.artifact import load_artifact


def test_loads_model_weights_and_tokenizer(artifact_dir):
    art = load_artifact(artifact_dir)
    assert art.model.num_layers == 2 and art.tokenizer is not None
    assert art.kv_cache_config.block_size == 4 and art.kv_cache_config.dtype == torch.float32
    assert art.scheduler_config.prefix_cache == "radix" and art.model_config.eos_token_ids == (2,)
    other = load_artifact(artifact_dir)  # a second load gets its own package: no shared module state
    assert type(other.model).__module__ != type(art.model).__module__


def test_schema_version_refused(artifact_copy):
    path = artifact_copy(lambda m: m.__setitem__("schema_version", 2))
    with pytest.raises(ArtifactError, match="schema version 2.*Recompile"):
        load_artifact(path)


@pytest.mark.parametrize("breakage, message", [
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    (lambda p: (p / "manifest.json").write_text("{oops"), "invalid JSON"),
    (lambda p: (p / "weights" / "rank0" / "model.safetensors").unlink(), "missing"),
    (lambda p: (p / "model.py").write_text("raise RuntimeError('boom')"), "boom"),
    (lambda p: (p / "__init__.py").unlink(), "importable as a package"),
    (lambda p: _edit(p, lambda m: m["entry"].__setitem__("class", "Nope")), "no class Nope"),
    (lambda p: _edit(p, lambda m: m["kv_cache"].__setitem__("dtype", "int3")), "unsupported dtype"),
])
def test_broken_artifacts_raise_artifact_error(artifact_copy, breakage, message):
    path = artifact_copy()
    breakage(path)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path).kv_cache_config  # noqa: B018


def _edit(path, fn):
    manifest = json.loads((path / "manifest.json").read_text())
    fn(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
