"""Where kiln decides how many threads each process computes with.

The engine-core process owns the cores: its torch intra-op pool has one thread per CPU it may run on (the
process's affinity mask, not the machine's core count), or `--num-threads`. An API server process does HTTP,
tokenization and detokenization on one thread and never runs the model: it does not import torch for itself,
and if a library pulls torch in anyway its pool is held to one thread, so it never competes with the core's.
`LLM` and `LLMEngine` (the core in the caller's process) leave torch's pool as the caller set it.

Placement (`kiln serve --core-cpus LIST`): the engine core pins itself to the CPUs it is given (`CoreConfig.cpus`)
before its pools start, one intra-op thread per CPU, and the API server moves to the CPUs it may use that the core
was not given, so that HTTP, detokenization and SSE never preempt a thread of the core's parallel regions (one
preempted thread stalls the others at the region's barrier). vLLM's CPU backend does the same by default (its
OpenMP threads bound to the cores, `VLLM_CPU_NUM_OF_RESERVED_CPU` left to the front-end). Several cores of one
`kiln serve` (data-parallel replicas, prefill and decode cores) get disjoint contiguous slices of the CPUs
(`split_cpus`), so that no two of them compute on the same CPU.

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


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (sorted, each once); ValueError with the reason for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (such as 0-3,8)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{part!r} in {text!r}: a range runs from low to high")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def check_cpus(cpus: list[int], what: str = "--core-cpus") -> None:
    """ValueError unless every CPU of `cpus` is one this process may run on."""
    allowed = allowed_cpus()
    outside = sorted(set(cpus) - set(allowed))
    if not cpus or outside:
        raise ValueError(f"{what} {format_cpu_list(cpus) or '(empty)'}: "
                         + (f"CPU {format_cpu_list(outside)} is not one this process may run on " if outside else "no CPU ")
                         + f"(allowed: {format_cpu_list(allowed)})")


def split_cpus(cpus: list[int], parts: int) -> list[list[int]] | None:
    """`cpus` in `parts` contiguous slices of sizes that differ by at most one, or None when there are fewer CPUs
    than parts (the cores then share them)."""
    if parts < 1 or len(cpus) < parts:
        return None
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(cpus[start:end])
        start = end
    return out


def pin(cpus: list[int]) -> None:
    """This process runs on `cpus` only: every thread it has (an affinity mask is a thread's own on Linux, and
    imports or a launcher may have started some already) and every thread they start from now on."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread, which the threads it starts inherit
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def place_api_server(core_cpus: list[int] | None) -> list[int] | None:
    """Moves the API server to the CPUs it may use that the engine core(s) were not given; returns them (None:
    nothing left over, or no placement asked for: it stays where it is and shares the core's CPUs)."""
    if not core_cpus:
        return None
    rest = sorted(set(allowed_cpus()) - set(core_cpus))
    if not rest:
        return None
    pin(rest)
    return rest


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
