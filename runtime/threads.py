"""Where kiln decides how many threads each process computes with.

The engine-core process owns the cores: its torch intra-op pool has one thread per CPU it may run on (the
process's affinity mask, not the machine's core count), or `--num-threads`. An API server process does HTTP,
tokenization and detokenization on one thread and never runs the model: it does not import torch for itself,
and if a library pulls torch in anyway its pool is held to one thread, so it never competes with the core's.
`LLM` and `LLMEngine` (the core in the caller's process) leave torch's pool as the caller set it.

OpenMP's idle threads sleep (`OMP_WAIT_POLICY=PASSIVE`) unless the environment says otherwise. The cpu target runs
torch ops on torch's OpenMP pool and the TVM kernels on TVM's own pool, one after the other on the same cores;
libgomp's default keeps each idle OpenMP worker spinning for ~300k iterations after every parallel region, on the
core a TVM worker (or, served, the API server) then needs. Passive waiting made `LLM.generate` 1.4-1.5x faster on
the embedded model and 1.13x on a 108 M Llama at batch 16-64 on 2 cores (docs/performance.md). libgomp reads the
variable once, when torch loads it: `prefer_passive_openmp` runs when `kiln.runtime` is imported, and has no
effect in a process that imported torch first (set the variable yourself there).
"""
from __future__ import annotations

import os
import sys

OPENMP_WAIT_ENV = "OMP_WAIT_POLICY"


def prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE, unless it is set, while torch (and with it libgomp) is not yet loaded."""
    if "torch" not in sys.modules:
        os.environ.setdefault(OPENMP_WAIT_ENV, "PASSIVE")


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_core(num_threads: int | None) -> int:
    """The engine-core process's intra-op threads; returns how many."""
    import torch

    n = num_threads or available_cpus()
    torch.set_num_threads(n)
    return n


def configure_api_server() -> None:
    """One thread for anything numeric in the API server process (tokenizers' own pool included)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
