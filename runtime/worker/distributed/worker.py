"""A rank worker: `python -m kiln.runtime.worker.distributed.worker ARTIFACT` with a torchrun-style environment.

    RANK, WORLD_SIZE          this rank and the artifact's ranks
    MASTER_ADDR, MASTER_PORT  rank 0's rendezvous store (the engine's process: `kiln serve` / `kiln.LLM`)
    LOCAL_RANK                the CUDA device (cuda:LOCAL_RANK) of a GPU artifact
    KILN_DIST_DEVICE          the device to load on (default: cpu, or cuda:LOCAL_RANK for a GPU artifact)
    KILN_WORKER_THREADS       torch threads (default 1)
    KILN_DIST_TIMEOUT         seconds a collective may take before the mesh is declared failed
    KILN_PARENT_PID           the spawning engine's pid: the worker exits when that process is gone

The engine spawns one per rank > 0 on its host; on other hosts a launcher (torchrun, slurm) starts them with the
same variables. The worker loads only weights/rank{RANK}/, says so in the store (or the error that stopped it), then
runs rank 0's step commands until told to stop or until rank 0 is gone.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ...artifact import load_artifact
from .comm import ProcessGroupComm
from .commands import RankState
from .executor import CONTROL_TIMEOUT_S, DEFAULT_TIMEOUT_S, STARTUP_TIMEOUT_S, worker_loop

logger = logging.getLogger("kiln.worker")


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives the engine that spawned it (even one killed with SIGKILL)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(4)
            time.sleep(0.5)

    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kiln.runtime.worker.distributed.worker ARTIFACT  (with RANK, WORLD_SIZE, MASTER_ADDR, "
              "MASTER_PORT set)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {os.environ.get('RANK', '?')} %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "KILN_PARENT_PID" in os.environ:
        _exit_with_parent(int(os.environ["KILN_PARENT_PID"]))
    threads = int(os.environ.get("KILN_WORKER_THREADS", "1"))
    torch.set_num_threads(threads)
    timeout = float(os.environ.get("KILN_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    startup = float(os.environ.get("KILN_DIST_STARTUP_TIMEOUT", STARTUP_TIMEOUT_S))
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          world, False, datetime.timedelta(seconds=startup))
    device = os.environ.get("KILN_DIST_DEVICE")
    try:
        if device is None:
            from ...manifest import read_manifest

            gpu = read_manifest(args[0])["device"] == "cuda"
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        art = load_artifact(args[0], device, load_tokenizer=False, rank=rank)
    except Exception as e:  # told to rank 0, which fails the start with it
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        return 1
    store.set(f"loaded/{rank}", "1")
    comm = ProcessGroupComm(rank, world, store, art.device, timeout=timeout, control_timeout=CONTROL_TIMEOUT_S)
    try:
        return worker_loop(RankState(art, comm), comm)
    finally:
        comm.close()


if __name__ == "__main__":
    sys.exit(main())
