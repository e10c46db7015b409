"""Builds an artifact's TVM kernel library at `kiln compile` time: `kernels/tvm_cpu/{kernels.py, cpu.so, build.json}`.

The TVMScript source is rendered from `codegen/templates/tvm/` for the model's attention shape and dtype, then
compiled with apache-tvm's LLVM backend for the host's x86-64 ISA level and linked into `cpu.so`; the source
stays beside the library. `build.json` records what the runtime needs to decide whether it may load the
library on a host (the CPU flags the code requires) and which functions it holds.

The library sits in its own folder: a `cpu.so` next to `kernels/cpu.py` would shadow that module (Python
tries extension modules before source files).

Builds are cached by the digest of (source, target, apache-tvm version) under `$KILN_CACHE_DIR/tvm` (default
`~/.cache/kiln/tvm`), so recompiling a recipe neither imports TVM nor runs LLVM again; the same source and
target give byte-identical libraries either way (checked by tests/codegen/test_tvm_build.py).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CodegenError

logger = logging.getLogger(__name__)

LIBRARY_DIR = "tvm_cpu"  # under the artifact's kernels/
LIBRARY_FILE = "cpu.so"
SOURCE_FILE = "kernels.py"
RECORD_FILE = "build.json"
BUILD_VERSION = 1  # bump when the build recipe below changes what a digest stands for


@dataclass(frozen=True)
class TVMKernel:
    """A kernel id of the tvm library: the TVMScript template that defines it and the PrimFuncs it calls."""

    template: str
    functions: tuple[str, ...]


# kernel id (as kernel selection picks it) -> its TVMScript. `tvm.embedding` has none: a row gather from the packed
# GEMM layout, in kernels/tvm.py.
TVM_KERNELS: dict[str, TVMKernel] = {
    "tvm.paged_attention": TVMKernel("tvm/paged_attention.py.j2", ("paged_attention", "kv_write", "kv_write_serial",
                                                                  "rope_kv_write", "rope_kv_write_serial")),
    "tvm.add_rms_norm": TVMKernel("tvm/norm.py.j2", ("add_rms_norm", "add_rms_norm_serial")),
    "tvm.rms_norm": TVMKernel("tvm/norm.py.j2", ("rms_norm", "rms_norm_serial")),
    "tvm.silu_mul": TVMKernel("tvm/norm.py.j2", ("silu_mul", "silu_mul_serial")),
    "tvm.linear": TVMKernel("tvm/linear.py.j2", ("linear",)),
    "tvm.logits": TVMKernel("tvm/linear.py.j2", ("linear",)),  # the LM head: the same packed GEMM
}


@dataclass(frozen=True)
class ISA:
    """An x86-64 micro-architecture level: LLVM's cpu name, the /proc/cpuinfo flags it implies, fp32 lanes."""

    mcpu: str
    flags: tuple[str, ...]
    lanes: int


_V3_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe")
ISAS: dict[str, ISA] = {
    "x86-64-v4": ISA("x86-64-v4", (*_V3_FLAGS, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"), 16),
    "x86-64-v3": ISA("x86-64-v3", _V3_FLAGS, 8),
}


# torch's CPU capability (the widest ISA its own kernels dispatch to on this host) -> the level built for
_CAPABILITY_ISA = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}


def host_isa() -> ISA | None:
    """The ISA the library is built for: `$KILN_TVM_ISA` if set (a key of ISAS, or "none"), else the level of
    this host's CPU as torch detects it; None below x86-64-v3 or off x86-64. The runtime checks build.json's
    `requires_cpu_flags` against the serving host's CPU before it loads the library."""
    forced = os.environ.get("KILN_TVM_ISA")
    if forced:
        if forced == "none":
            return None
        if forced not in ISAS:
            raise CodegenError(f"KILN_TVM_ISA={forced!r}: expected one of {', '.join(ISAS)} or 'none'", None)
        return ISAS[forced]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import torch

    level = _CAPABILITY_ISA.get(torch.backends.cpu.get_cpu_capability())
    return ISAS[level] if level else None


def render_params(params: Mapping[str, Any], isa: ISA) -> dict[str, Any]:
    """Template parameters: the artifact's kernel params plus the tile sizes chosen here for them."""
    group = max(1, int(params["num_heads"]) // max(1, int(params["num_kv_heads"])))
    return {"head_dim": int(params["head_dim"]), "num_heads": int(params["num_heads"]),
            "num_kv_heads": int(params["num_kv_heads"]), "block_size": int(params["block_size"]),
            "dtype": str(params["dtype"]), "isa": isa.mcpu, "lanes": isa.lanes,
            # query tokens per attention work item: up to 16 rows (tokens x GQA group) share each K/V block load
            "q_tile": max(1, 16 // group)}


def render_source(env, kernel_ids: Iterable[str], params: Mapping[str, Any], kiln_version: str) -> str:
    """The TVMScript of `kernel_ids` (each template once): prelude, then each kernel template, in id order."""
    templates = sorted({TVM_KERNELS[k].template for k in kernel_ids})
    parts = [env.get_template("tvm/prelude.py.j2").render(kiln_version=kiln_version, **params)]
    parts += [env.get_template(t).render(kiln_version=kiln_version, **params) for t in templates]
    return "".join(parts)


def target_of(isa: ISA) -> dict[str, Any]:
    """The LLVM target dict. Reassociation and contraction let LLVM vectorise the fp32 dot products and fuse
    multiply-adds (results move by rounding only); no finite-math flags: masked scores are finite sentinels."""
    return {"kind": "llvm", "mcpu": isa.mcpu, "fast-math-reassoc": True, "fast-math-contract": True}


def cache_dir() -> Path:
    base = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(base) / "tvm"


def _tvm_version() -> str | None:
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _compile(source_file: Path, functions: list[str], target: dict[str, Any], out: Path) -> None:
    """Imports the rendered TVMScript, compiles its PrimFuncs with LLVM and links them into `out`."""
    import tvm  # the compiler: only here, never at serve time

    spec = importlib.util.spec_from_file_location(f"_kiln_tvm_{source_file.parent.name}", source_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # TVMScript parses each @T.prim_func from this real file
    ir = tvm.IRModule({name: getattr(module, name) for name in functions})
    lib = tvm.compile(ir, target=tvm.target.Target(target))
    lib.export_library(str(out))


def build_library(kernel_ids: Iterable[str], params: Mapping[str, Any], kernels_dir: Path, *, env,
                  kiln_version: str) -> dict[str, Any] | None:
    """Writes `kernels_dir/tvm_cpu/` for the tvm kernels among `kernel_ids` and returns its build record; None
    (nothing written) when the program selected no tvm kernel. When no library can be built here (no apache-tvm,
    a CPU below x86-64-v3, no C compiler), the folder holds only build.json saying why, and the artifact's
    tvm library runs the torch kernels (it says so in one log line when loaded)."""
    ids = sorted(k for k in set(kernel_ids) if k in TVM_KERNELS)
    if not ids:
        return None
    out = kernels_dir / LIBRARY_DIR
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"build_version": BUILD_VERSION, "kernels": ids, "library": None}
    isa, version = host_isa(), _tvm_version()
    if isa is None or version is None:
        record["reason"] = ("apache-tvm is not installed where the artifact was compiled" if version is None else
                            "KILN_TVM_ISA=none" if os.environ.get("KILN_TVM_ISA") == "none" else
                            "the compiling host's CPU is not x86-64-v3 or better (KILN_TVM_ISA overrides)")
        logger.warning("kiln: TVM kernels not built (%s); the artifact runs torch kernels", record["reason"])
        _write_json(out / RECORD_FILE, record)
        return record
    rparams = render_params(params, isa)
    source = render_source(env, ids, rparams, kiln_version)
    functions = sorted({f for k in ids for f in TVM_KERNELS[k].functions})
    target = target_of(isa)
    digest = hashlib.sha256(json.dumps({"source": source, "target": target, "tvm": version, "functions": functions,
                                        "build_version": BUILD_VERSION}, sort_keys=True).encode()).hexdigest()
    cached = cache_dir() / digest[:32]
    library = cached / LIBRARY_FILE
    if not library.is_file():
        try:
            _build_into(cached, source, functions, target)
        except Exception as e:  # a host that cannot build (no C compiler, LLVM refusing the target) still compiles
            record["reason"] = f"building with apache-tvm {version} failed: {type(e).__name__}: {e}"
            logger.warning("kiln: TVM kernels not built (%s); the artifact runs torch kernels", record["reason"])
            _write_json(out / RECORD_FILE, record)
            return record
    (out / SOURCE_FILE).write_text(source, encoding="utf-8")
    shutil.copyfile(library, out / LIBRARY_FILE)
    record.update({"library": LIBRARY_FILE, "source": SOURCE_FILE, "functions": functions, "target": target,
                   "requires_cpu_flags": list(isa.flags), "apache_tvm": version, "params": rparams,
                   "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
                   "library_sha256": hashlib.sha256(library.read_bytes()).hexdigest()})
    _write_json(out / RECORD_FILE, record)
    return record


def write_cpu_kernels(kernels_dir: Path, params: Mapping[str, Any], kernel_ids: Iterable[str], *,
                      kiln_version: str) -> dict[str, Any] | None:
    """The cpu target's kernels/ folder for `params` alone (no model): the torch library, the tvm library module
    and its build — what tests and benchmarks/cpu_kernels.py import as a package."""
    from .render import template_env

    env = template_env()
    kernels_dir.mkdir(parents=True, exist_ok=True)
    (kernels_dir / "__init__.py").write_text("", encoding="utf-8")
    for name, template in (("cpu", "cpu/kernels.py.j2"), ("tvm", "tvm/library.py.j2")):
        text = env.get_template(template).render(kiln_version=kiln_version, **params)
        (kernels_dir / f"{name}.py").write_text(text, encoding="utf-8")
    return build_library(kernel_ids, params, kernels_dir, env=env, kiln_version=kiln_version)


def _build_into(cached: Path, source: str, functions: list[str], target: dict[str, Any]) -> None:
    """Builds in a fresh folder beside the cache entry and renames it into place, so a concurrent or interrupted
    build never leaves a half-written library under the digest."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        (work / SOURCE_FILE).write_text(source, encoding="utf-8")
        _compile(work / SOURCE_FILE, functions, target, work / LIBRARY_FILE)
        try:
            work.rename(cached)
        except OSError:  # another build of the same digest won the race: its library is as good
            if not (cached / LIBRARY_FILE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["ISAS", "LIBRARY_DIR", "TVM_KERNELS", "build_library", "cache_dir", "host_isa", "render_params",
           "render_source", "target_of", "write_cpu_kernels"]
