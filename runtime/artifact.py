"""Loading a compiled artifact directory: manifest, generated model package, weights, tokenizer."""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import (
    CUDAGraphConfig,
    KVCacheConfig,
    ModelConfig,
    SchedulerConfig,
    cuda_graph_config_from_manifest,
    kv_cache_config_from_manifest,
    model_config_from_manifest,
    scheduler_config_from_manifest,
)
from .errors import ArtifactError

SCHEMA_VERSION = 1
_REQUIRED_SECTIONS = ("runtime", "kv_cache", "weights", "entry")
_package_ids = itertools.count()
_CUDA_TARGETS = ("h100", "h200")  # artifacts whose kernels are Triton, for NVIDIA GPUs


@dataclass
class LoadedArtifact:
    path: Path
    manifest: dict
    model: Any  # the generated Model: forward(ForwardBatch, list[Tensor]) -> Tensor
    tokenizer: Any  # kiln.runtime.tokenizer.Tokenizer | None
    device: torch.device
    model_config: ModelConfig
    kv_cache_config: KVCacheConfig
    scheduler_config: SchedulerConfig
    cuda_graph_config: CUDAGraphConfig | None = None  # GPU artifacts: the decode capture plan


def read_manifest(path: str | Path) -> dict:
    """Reads and checks `ART/manifest.json`; raises `ArtifactError` on anything a runtime cannot serve."""
    art = Path(path)
    file = art / "manifest.json"
    if not file.is_file():
        raise ArtifactError(f"{art}: not a kiln artifact (no manifest.json); build one with `kiln compile`")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{file}: expected a JSON object")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{file}: artifact schema version {version!r} (kiln {manifest.get('kiln_version', '?')}) is not "
            f"supported; this runtime reads schema version {SCHEMA_VERSION}. Recompile the recipe with this kiln.")
    missing = [s for s in _REQUIRED_SECTIONS if not isinstance(manifest.get(s), dict)]
    if missing:
        raise ArtifactError(f"{file}: missing section(s) {', '.join(missing)}")
    return manifest


def load_artifact(path: str | Path, device: str | torch.device = "cpu", *,
                  load_tokenizer: bool = True) -> LoadedArtifact:
    art = Path(path).resolve()
    manifest = read_manifest(art)
    device = torch.device(device)
    _check_device(art, manifest, device)
    model_cls = _import_entry(art, manifest)
    weights = _load_weights(art, manifest, device)
    try:
        model = model_cls(weights, device)
    except Exception as e:  # generated code failing on its own weights is an artifact problem
        raise ArtifactError(f"{art}: Model(weights) failed: {type(e).__name__}: {e}") from e
    tokenizer = None
    tok_dir = art / manifest.get("tokenizer", {}).get("dir", "tokenizer")
    if load_tokenizer and (tok_dir / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(tok_dir)
    return LoadedArtifact(path=art, manifest=manifest, model=model, tokenizer=tokenizer, device=device,
                          model_config=model_config_from_manifest(manifest),
                          kv_cache_config=kv_cache_config_from_manifest(manifest),
                          scheduler_config=scheduler_config_from_manifest(manifest),
                          cuda_graph_config=cuda_graph_config_from_manifest(manifest))


def _check_device(art: Path, manifest: dict, device: torch.device) -> None:
    """A GPU artifact loads on a CUDA device (or on CPU under Triton's interpreter, TRITON_INTERPRET=1, which
    is how kiln tests its kernels without a GPU); anything else is refused here, before weights load."""
    target = manifest.get("target", "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(f"{art}: asked to load on {device}, but this machine has no CUDA device")
    if target in _CUDA_TARGETS and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        why = ("this machine has no CUDA device" if not torch.cuda.is_available()
               else f"it was asked to load on {device}")
        raise ArtifactError(f"{art}: compiled for target {target!r} (Triton kernels for NVIDIA GPUs), but {why}; "
                            "load it with device='cuda' on a GPU machine, or compile the recipe with --target cpu")


def _import_entry(art: Path, manifest: dict) -> type:
    """Imports ART as a package under a fresh name, so relative imports (`from .kernels import cpu`) work and
    two artifacts loaded in one process never share modules."""
    entry = manifest["entry"]
    module_name, class_name = entry.get("module", "model"), entry.get("class", "Model")
    if not (art / "__init__.py").is_file():
        raise ArtifactError(f"{art}: missing __init__.py (the artifact must be importable as a package)")
    package = f"_kiln_artifact_{next(_package_ids)}"
    spec = importlib.util.spec_from_file_location(package, art / "__init__.py",
                                                  submodule_search_locations=[str(art)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[package] = pkg
    try:
        spec.loader.exec_module(pkg)
        module = importlib.import_module(f"{package}.{module_name}")
    except Exception as e:
        raise ArtifactError(f"{art}: importing {module_name}.py failed: {type(e).__name__}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ArtifactError(f"{art}/{module_name}.py defines no class {class_name}")
    return cls


def _load_weights(art: Path, manifest: dict, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    wcfg = manifest["weights"]
    wdir = art / wcfg.get("dir", "weights/rank0")
    files = wcfg.get("files") or sorted(p.name for p in wdir.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{wdir}: no .safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        file = wdir / name
        if not file.is_file():
            raise ArtifactError(f"{file}: weight file listed in manifest.json is missing")
        shard = load_file(str(file), device=str(device))
        dup = weights.keys() & shard.keys()
        if dup:
            raise ArtifactError(f"{file}: tensor(s) {sorted(dup)[:3]} also appear in another weight file")
        weights.update(shard)
    for alias, stored in (wcfg.get("aliases") or {}).items():  # a tensor the converter stored once
        if stored not in weights:
            raise ArtifactError(f"manifest.json: weight alias {alias!r} names missing tensor {stored!r}")
        weights[alias] = weights[stored]
    return weights
