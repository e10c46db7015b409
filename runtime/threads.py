"""Where kiln decides how many threads each process computes with.

The engine-core process owns the cores: its torch intra-op pool has one thread per CPU it may run on (the
process's affinity mask, not the machine's core count), or `--num-threads`. An API server process does HTTP,
tokenization and detokenization on one thread and never runs the model: it does not import torch for itself,
and if a library pulls torch in anyway its pool is held to one thread, so it never competes with the core's.
`LLM` and `LLMEngine` (the core in the caller's process) leave torch's pool as the caller set it.
"""
from __future__ import annotations

import os
import sys


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
