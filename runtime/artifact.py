"""Loading a compiled artifact directory: manifest, generated model package, weights, tokenizer."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import itertools
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
from .manifest import read_manifest
from .tokenizer import open_tokenizer

_package_ids = itertools.count()
_HASH_CHUNK = 16 * 2**20


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
    rank: int = 0  # a parallel artifact: the rank whose weights (weights/rank{r}/) `model` holds

    @property
    def world_size(self) -> int:
        """Ranks of the artifact's mesh (1: a single-device artifact)."""
        return int((self.manifest.get("parallel") or {}).get("world_size", 1))


def load_artifact(path: str | Path, device: str | torch.device = "cpu", *,
                  load_tokenizer: bool = True, rank: int = 0) -> LoadedArtifact:
    """Loads an artifact, refusing (ArtifactError) what would fail later: a manifest outside the schema, a
    generated model that disagrees with it, weight files that are not the ones compiled (sha256 per file) or
    whose tensors differ from the manifest's names, dtypes and shapes, a tokenizer that does not load.

    A parallel artifact (manifest `parallel`): `rank`'s model, from its own shards (weights/rank{rank}/, checked
    against `parallel.ranks[rank]`); no other rank's file is opened. Its communicator is bound by the
    executor that runs the ranks (runtime/worker/distributed/), before the first forward."""
    art = Path(path).resolve()
    manifest = read_manifest(art)
    device = torch.device(device)
    _check_device(art, manifest, device)
    world = int((manifest.get("parallel") or {}).get("world_size", 1))
    if not 0 <= rank < world:
        raise ArtifactError(f"{art}: rank {rank} of an artifact compiled for {world} rank(s)")
    model_cls = _import_entry(art, manifest)
    section = manifest["parallel"]["ranks"][rank] if world > 1 else manifest["weights"]
    weights = _load_weights(art, section, device)
    try:
        model = model_cls(weights, device, rank=rank) if world > 1 else model_cls(weights, device)
    except Exception as e:  # generated code failing on its own weights is an artifact problem
        raise ArtifactError(f"{art}: Model(weights) failed: {type(e).__name__}: {e}") from e
    tokenizer = None
    tok = manifest.get("tokenizer")  # null: an artifact without one (random weights) serves token ids only
    if load_tokenizer and tok is not None:
        tokenizer = open_tokenizer(art / tok["dir"], manifest["runtime"]["vocab_size"])
    return LoadedArtifact(path=art, manifest=manifest, model=model, tokenizer=tokenizer, device=device,
                          model_config=model_config_from_manifest(manifest),
                          kv_cache_config=kv_cache_config_from_manifest(manifest),
                          scheduler_config=scheduler_config_from_manifest(manifest),
                          cuda_graph_config=cuda_graph_config_from_manifest(manifest), rank=rank)


def _check_device(art: Path, manifest: dict, device: torch.device) -> None:
    """A GPU artifact loads on a CUDA device (or on CPU under Triton's interpreter, TRITON_INTERPRET=1, which
    is how kiln tests its kernels without a GPU); anything else is refused here, before weights load."""
    target = manifest["target"]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(f"{art}: asked to load on {device}, but this machine has no CUDA device")
    if manifest["device"] == "cuda" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        why = ("this machine has no CUDA device" if not torch.cuda.is_available()
               else f"it was asked to load on {device}")
        raise ArtifactError(f"{art}: compiled for target {target!r} (Triton kernels for NVIDIA GPUs), but {why}; "
                            "load it with device='cuda' on a GPU machine, or compile the recipe with --target cpu")


def _import_entry(art: Path, manifest: dict) -> type:
    """Imports ART as a package under a fresh name, so relative imports (`from .kernels import cpu`) work and
    two artifacts loaded in one process never share modules. The generated module's constants must agree with
    the manifest: its rotary tables hold MAX_MODEL_LEN positions and its logits VOCAB_SIZE rows."""
    entry = manifest["entry"]
    module_name, class_name = entry["module"], entry["class"]
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
    rt = manifest["runtime"]
    built = getattr(module, "MAX_MODEL_LEN", None)
    if isinstance(built, int) and rt["max_model_len"] > built:
        raise ArtifactError(f"{art}: manifest.json runtime.max_model_len = {rt['max_model_len']}, but {module_name}.py "
                            f"was generated for at most {built} positions (its rotary tables); recompile with "
                            "serve { max_model_len = ... } instead of editing the manifest")
    vocab = getattr(module, "VOCAB_SIZE", None)
    if isinstance(vocab, int) and rt["vocab_size"] != vocab:
        raise ArtifactError(f"{art}: manifest.json runtime.vocab_size = {rt['vocab_size']}, but the model's logits "
                            f"have {vocab} rows ({module_name}.py VOCAB_SIZE)")
    mesh = getattr(module, "MESH", {"world_size": 1})
    world = int((manifest.get("parallel") or {}).get("world_size", 1))
    if mesh.get("world_size") != world:
        raise ArtifactError(f"{art}: manifest.json describes {world} rank(s), but {module_name}.py was generated for "
                            f"{mesh.get('world_size')} (MESH); recompile the recipe")
    return cls


def _load_weights(art: Path, wcfg: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of one weights section (`weights`, or a rank's `parallel.ranks[r]`), checked against it."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    wdir = art / wcfg["dir"]
    expected: dict[str, dict[str, dict]] = {name: {} for name in wcfg["files"]}
    for tensor, meta in wcfg["tensors"].items():
        expected[meta["file"]][tensor] = meta
    files = [wdir / name for name in wcfg["files"]]
    for file in files:
        if not file.is_file():
            raise ArtifactError(f"{file}: weight file listed in manifest.json is missing")
    for file, digest in zip(files, _digests(files), strict=True):
        if digest != wcfg["sha256"][file.name]:
            raise ArtifactError(f"{file}: the file is not the one compiled (sha256 {digest[:16]}..., manifest.json "
                                f"records {wcfg['sha256'][file.name][:16]}...): truncated, corrupted or replaced; "
                                "recompile the recipe")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        want = expected[file.name]
        try:
            with safe_open(str(file), framework="pt") as f:
                header = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            _check_header(file, header, want)
            # On the CPU each tensor is read into its own memory (pread), not mapped from the file: the generated
            # model may replace tensors when it is built (the tvm GEMM's packed weights), and a file mapping keeps
            # the replaced tensors' pages resident for as long as any tensor of the file lives.
            shard = load_file(str(file), device=str(device), backend="pread" if device.type == "cpu" else "mmap")
        except SafetensorError as e:
            raise ArtifactError(f"{file}: not a readable safetensors file ({e})") from None
        weights.update(shard)
    for alias, stored in wcfg.get("aliases", {}).items():  # a tensor the converter stored once
        weights[alias] = weights[stored]
    return weights


def _check_header(file: Path, header: dict[str, tuple[str, list[int]]], want: dict[str, dict]) -> None:
    """The file's tensors are exactly the manifest's, with its dtypes and shapes."""
    missing, extra = sorted(want.keys() - header.keys()), sorted(header.keys() - want.keys())
    if missing or extra:
        what = "; ".join(part for part in (f"missing {missing[:3]}" if missing else "",
                                           f"unexpected {extra[:3]}" if extra else "") if part)
        raise ArtifactError(f"{file}: tensors differ from manifest.json ({what})")
    for name, (dtype, shape) in sorted(header.items()):
        meta = want[name]
        if dtype != meta["dtype"] or list(shape) != meta["shape"]:
            raise ArtifactError(f"{file}: tensor {name!r} is {dtype} {list(shape)}, manifest.json (and the generated "
                                f"model) expect {meta['dtype']} {meta['shape']}")


def _digests(files: list[Path]) -> list[str]:
    """sha256 of each file, hashed in parallel threads (hashlib releases the GIL on large reads)."""
    from concurrent.futures import ThreadPoolExecutor

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    if len(files) == 1:
        return [digest(files[0])]
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        return list(pool.map(digest, files))
