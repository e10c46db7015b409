"""Loads an artifact's TVM kernel library (`kernels/tvm_cpu/cpu.so`) without the TVM compiler.

The library is loaded through tvm-ffi (`apache-tvm-ffi`) after TVM's runtime library (`libtvm_runtime.so`, 3 MB,
found in the installed apache-tvm package without importing it: the compiler and its 260 MB library are never
mapped at serve time). The runtime library supplies the thread pool the kernels' parallel loops launch on.

`load_library` returns None, after one log line saying why, when the library cannot serve on this host: not
built at compile time, a CPU lacking the flags it was compiled for, no apache-tvm / tvm-ffi installed, or a
failed load. The artifact's tvm kernel module then runs the torch kernels.

bf16 GEMMs: `bf16_gemm_backend` decides, once per process, who runs a bf16 artifact's GEMMs, and says which in one
log line. On a CPU without native bf16 arithmetic: this library's `linear` (`tvm`: bf16 weights widened to fp32 in
registers; torch's oneDNN bf16 GEMM emulates it there and measured 3-8x slower than its own fp32 from 16 rows on).
On a CPU with `avx512_bf16` or `amx_bf16`: oneDNN's native bf16 kernels over weights reordered once, when the model
is built, into oneDNN's blocked layout (`onednn`: `torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`,
the prepacked path torch's inductor freezes weights into). Results are bit-identical to `F.linear` over the weights
as stored, which re-lays the weight out on every call: 1.3-1.8x the prepacked time at one row, 1.2-1.4x at 16, ~1.05-1.1x at
64 (docs/performance.md, "bf16 GEMMs on a CPU with avx512_bf16"). `torch` (`F.linear`, nothing packed) is left for a
torch without those ops. `KILN_CPU_BF16_GEMM=tvm|onednn|torch` overrides the choice.

Threads: TVM keeps its own pthread pool (one per calling thread), sized when the first parallel kernel runs
from `TVM_NUM_THREADS`. Unless that is set, it is set here to torch's intra-op thread count, so both pools use
the same cores. `TVM_THREAD_POOL_SPIN_COUNT` defaults to 30000 here (TVM's own default spins 300k iterations
after every call; 0, the earlier choice, made every parallel call wake a sleeping worker): with the GEMMs on
TVM too and torch's OpenMP threads asleep when idle (runtime/threads.py), a short spin measured 1.4-2.8x the
decode throughput of 0 at batch 1 and 1.1-1.3x at batch 16-64 (docs/performance.md, "TVM workers: a short
spin"); the earlier finding, spinning TVM workers slowing torch's GEMMs 1.4-7.5x, was with GEMMs on torch.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RECORD_FILE = "build.json"
_loaded: dict[tuple[Path, str], Library | None] = {}  # (folder, library digest) -> what loading it gave
_mapped: dict[str, str] = {}  # library file path -> digest of the library the dynamic loader mapped from it
_private: list[Path] = []  # this process's directory of library copies (made once, by mkdtemp)


@dataclass
class Library:
    """A loaded kernel library: its functions by name (tvm-ffi callables taking torch tensors zero-copy, through
    DLPack) and the parameters it was rendered for (build.json's `params`)."""

    path: Path
    params: dict[str, Any]
    functions: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.functions[name]
        except KeyError:
            raise AttributeError(f"{self.path}: no kernel {name!r}") from None


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of the x86 bf16 dot-product instructions
BF16_GEMM_ENV = "KILN_CPU_BF16_GEMM"
BF16_GEMM_BACKENDS = ("tvm", "onednn", "torch")
_BF16_GEMM_WHAT = {"tvm": "TVM linear (bf16 weights, fp32 math)",
                   "onednn": "oneDNN (native bf16, weights prepacked in its blocked layout)",
                   "torch": "torch F.linear (oneDNN native bf16, weights as stored)"}
_bf16_choice: list[str] = []  # the process's decision, made once


def bf16_gemm_backend(flags: frozenset[str] | None = None) -> str:
    """"tvm", "onednn" or "torch": who runs a bf16 artifact's GEMMs on this host (see the module docstring).
    Decided and logged once per process (`flags` given: decided afresh for those CPU flags, not logged or kept,
    for tests). A forced `onednn` on a torch or CPU without oneDNN's bf16 matmul is a ValueError."""
    if flags is None and _bf16_choice:
        return _bf16_choice[0]
    have = sorted(set(NATIVE_BF16_FLAGS) & (_cpu_flags() if flags is None else flags))
    forced = os.environ.get(BF16_GEMM_ENV, "").strip().lower()
    if forced and forced not in BF16_GEMM_BACKENDS:
        raise ValueError(f"{BF16_GEMM_ENV}={forced!r}: expected one of {', '.join(BF16_GEMM_BACKENDS)}")
    if forced == "onednn" and not onednn_bf16_available():
        raise ValueError(f"{BF16_GEMM_ENV}=onednn: this torch build or CPU has no oneDNN bf16 matmul "
                         "(torch.ops.mkldnn._is_mkldnn_bf16_supported() is False)")
    choice = forced or (("onednn" if onednn_bf16_available() else "torch") if have else "tvm")
    if flags is None:
        _bf16_choice.append(choice)
        why = (f"{BF16_GEMM_ENV}={forced}" if forced else
               f"this CPU has {' and '.join(have)}" if have else f"this CPU has no {' or '.join(NATIVE_BF16_FLAGS)}")
        logger.info("kiln: bf16 GEMMs on %s (%s)", _BF16_GEMM_WHAT[choice], why)
    return choice


def onednn_bf16_available() -> bool:
    """torch has the prepacked oneDNN linear (`mkldnn._reorder_linear_weight`, `_linear_pointwise`) and oneDNN
    runs bf16 matmuls on this CPU."""
    try:
        import torch
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))
    except (ImportError, AttributeError, RuntimeError):
        return False


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _runtime_library() -> Path:
    """libtvm_runtime.so of the installed apache-tvm, located without importing the `tvm` package."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("apache-tvm is not installed")
    for folder in spec.submodule_search_locations:
        lib = Path(folder) / "lib" / "libtvm_runtime.so"
        if lib.is_file():
            return lib
    raise ImportError("the installed apache-tvm has no lib/libtvm_runtime.so")


TVM_SPIN_COUNT = 30000  # iterations an idle TVM worker spins after a call before it sleeps


TVM_THREADS_SET_BY_KILN = "KILN_TVM_NUM_THREADS_AUTO"  # the TVM_NUM_THREADS value kiln chose for its process


def configure_threads() -> None:
    """Sizes TVM's pool like torch's (unless the user set TVM_NUM_THREADS) and lets its workers spin briefly
    between calls (TVM_THREAD_POOL_SPIN_COUNT, unless set). Takes effect for pools not yet started.

    TVM reads the size from the environment, which child processes inherit: a value kiln chose for one process
    (marked by KILN_TVM_NUM_THREADS_AUTO holding it) is chosen afresh in a child with another torch pool — an engine
    core, a rank worker, a torchrun rank started from a script that ran an `LLM` — and only a value set otherwise is
    the user's. (A rank 0 of a gloo mesh with a 2-thread TVM pool beside a 1-thread torch pool aborted at exit, in
    about half of the runs.)"""
    mine = os.environ.get(TVM_THREADS_SET_BY_KILN)
    if "TVM_NUM_THREADS" not in os.environ or os.environ["TVM_NUM_THREADS"] == mine:
        import torch

        os.environ["TVM_NUM_THREADS"] = os.environ[TVM_THREADS_SET_BY_KILN] = str(torch.get_num_threads())
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(TVM_SPIN_COUNT))
    # TVM binds its worker k to the machine's CPU k and widens the calling thread's affinity to every CPU of the
    # machine, whatever the process's own mask: a process confined to some CPUs (taskset, `--core-cpus`, one of
    # several replicas) would have its threads moved off them, and two such processes would share CPUs 1..n-1
    # while the others idle. Within a mask the threads are left to the OS, as torch's OpenMP threads are.
    if "TVM_BIND_THREADS" not in os.environ and hasattr(os, "sched_getaffinity") and \
            len(os.sched_getaffinity(0)) < (os.cpu_count() or 0):
        os.environ["TVM_BIND_THREADS"] = "0"


def _private_dir() -> Path:
    """This process's directory for library copies: made by mkdtemp (mode 0700, a name nobody can plant in
    advance), removed at exit, and checked to be a directory of this user that nobody else can write."""
    if not _private:
        _private.append(Path(tempfile.mkdtemp(prefix="kiln-tvm-")))
        atexit.register(shutil.rmtree, _private[0], True)
    folder = _private[0]
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{folder}: not a private directory of this user; TVM library copies are not made there")
    return folder


def library_to_map(library: Path, digest: str) -> Path:
    """The file the dynamic loader is to map for `library` (build.json's `library_sha256` `digest`), its content
    checked against the digest first (ValueError: not loaded). The loader maps a path once per process: a
    different library recompiled at a path already mapped is loaded from a copy of the checked bytes in this
    process's private directory instead (a copy found there with other content is replaced), so it is never
    served the earlier one's code, nor a file another user put in a shared temp directory."""
    data = library.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{library} does not match {RECORD_FILE}'s library_sha256 {digest[:16]}...: not loaded")
    if _mapped.setdefault(str(library), digest) == digest:
        return library
    copy = _private_dir() / f"{digest}.so"
    if not copy.is_file() or hashlib.sha256(copy.read_bytes()).hexdigest() != digest:
        partial = copy.with_suffix(".partial")
        partial.write_bytes(data)
        os.replace(partial, copy)
    return copy


def _load_module(library: Path, digest: str) -> Any:
    """Loads the library file (library_to_map's) through tvm-ffi (or the compiler's runtime when it is imported
    anyway)."""
    library = library_to_map(library, digest)
    if "tvm" in sys.modules and sys.modules["tvm"] is not None:  # the compiler is already here (compile + serve)
        return sys.modules["tvm"].runtime.load_module(str(library))
    import tvm_ffi  # first: it loads libtvm_ffi.so, which libtvm_runtime.so links against

    ctypes.CDLL(str(_runtime_library()), mode=ctypes.RTLD_GLOBAL)  # registers the pool the kernels launch on

    return tvm_ffi.load_module(str(library))


def load_library(folder: str | Path) -> Library | None:
    """The kernel library in `folder` (an artifact's kernels/tvm_cpu), or None (logged once) when it cannot run
    here, or silently when `folder` does not exist (the artifact selected no tvm kernel). Loaded once per process
    per folder and library digest."""
    folder = Path(folder).resolve()
    if not (folder / RECORD_FILE).is_file():
        return None
    try:
        record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("kiln: %s unreadable (%s); using torch kernels", folder / RECORD_FILE, e)
        return None
    key = (folder, str(record.get("library_sha256")))
    if key not in _loaded:
        try:
            _loaded[key] = _load(folder, record)
        except Exception as e:
            logger.warning("kiln: TVM kernels in %s not loaded (%s: %s); using torch kernels", folder,
                           type(e).__name__, e)
            _loaded[key] = None
    return _loaded[key]


def _load(folder: Path, record: dict) -> Library | None:
    if not record.get("library"):
        logger.warning("kiln: %s has no TVM library (%s); using torch kernels", folder,
                       record.get("reason", "not built"))
        return None
    missing = sorted(set(record.get("requires_cpu_flags", ())) - _cpu_flags())
    if missing:
        logger.warning("kiln: TVM kernels in %s were built for %s; this CPU lacks %s; using torch kernels", folder,
                       record.get("target", {}).get("mcpu", "another CPU"), " ".join(missing))
        return None
    configure_threads()
    module = _load_module(folder / record["library"], str(record.get("library_sha256")))
    functions = {name: module[name] for name in record["functions"]}
    return Library(path=folder, params=dict(record.get("params", {})), functions=functions)


__all__ = ["NATIVE_BF16_FLAGS", "Library", "bf16_gemm_backend", "configure_threads", "load_library",
           "onednn_bf16_available"]
