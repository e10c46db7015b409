"""Communicators: what a parallel artifact's collective kernels call (`comm.all_reduce(x)` ...), over torch.distributed
process groups (gloo on CPU, NCCL on CUDA) or, for the single-process mesh, between threads sharing one device.

Contract (the generated kernels rely on exactly this; `x` is this rank's tensor):
  all_reduce(x)                  -> the sum over ranks (may be x, reduced in place)
  all_gather(x, dim)             -> the ranks' x concatenated along dim, in rank order (equal shapes)
  all_gather_rows(x, counts)     -> the ranks' rows (rank r has counts[r]) concatenated in rank order
  reduce_scatter_rows(x, counts) -> x is [sum(counts), ...] partial on every rank: this rank's rows of the sum
  all_to_all(x, send, recv)      -> x's first send[r] rows go to rank r, the next send[r+1] to rank r+1...; the
                                    rows every rank sent this one (recv[r] from rank r), in rank order
A failure to communicate (a peer gone or not answering within the timeout) raises `CommError`: the mesh cannot run
another step.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from ..interface import ExecutorError

Tensor = torch.Tensor


class CommError(ExecutorError):
    """A collective failed: a rank died, hung past the timeout, or the mesh was shut down."""


def _rows_offset(counts: list[int], rank: int) -> int:
    return sum(counts[:rank])


class ProcessGroupComm:
    """One rank of a torch.distributed mesh. Two groups over one store: `data` for the model's collectives (gloo on
    CPU, NCCL on CUDA; `timeout` bounds every one), `control` (gloo, host tensors) for the step commands rank 0
    broadcasts, with `control_timeout` (a worker waits for the next step as long as the server is idle; rank 0's
    sends, which gloo completes only once the receiver takes them, are bounded by the mesh timeout)."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, device: torch.device, *,
                 timeout: float, control_timeout: float) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timeout
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size,
                                             datetime.timedelta(seconds=control_timeout))
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout)
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world_size, opts)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world_size,
                                              datetime.timedelta(seconds=timeout))
        self.failed: str | None = None

    def _wait(self, work, what: str) -> None:
        if self.failed is not None:
            raise CommError(f"rank {self.rank}: the mesh failed earlier ({self.failed})")
        try:
            work.wait()
        except RuntimeError as e:  # a peer closed its connection, or the timeout passed
            self.failed = f"{what}: {str(e).splitlines()[0][:300]}"
            raise CommError(f"rank {self.rank}: {self.failed}") from None

    # ---- the model's collectives
    def all_reduce(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        self._wait(self.data.allreduce([x]), "all_reduce")
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._wait(self.data.allgather([parts], [x]), "all_gather")
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: Tensor, counts: list[int]) -> Tensor:
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(self.data.allgather([parts], [padded]), "all_gather_rows")
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)], dim=0)

    def reduce_scatter_rows(self, x: Tensor, counts: list[int]) -> Tensor:
        start = _rows_offset(counts, self.rank)
        if self.device.type == "cuda":  # NCCL reduce-scatter over rows padded to the largest rank's count
            most = max(counts)
            padded = x.new_zeros((self.world_size * most, *x.shape[1:]))
            offset = 0
            for r, n in enumerate(counts):
                padded[r * most:r * most + n] = x[offset:offset + n]
                offset += n
            out = x.new_empty((most, *x.shape[1:]))
            self._wait(self.data._reduce_scatter_base(out, padded), "reduce_scatter_rows")
            return out[:counts[self.rank]]
        # gloo's reduce-scatter is one all-reduce per rank (pytorch#149869); one all-reduce and a slice is cheaper
        return self.all_reduce(x)[start:start + counts[self.rank]]

    def all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._wait(self.data.alltoall_base(out, x, recv, send, dist.AllToAllOptions()), "all_to_all")
        return out

    # ---- rank 0's commands
    def broadcast_command(self, payload: Tensor | None) -> Tensor:
        """Rank 0 sends `payload` (int64, host); the others receive it. Two broadcasts: its length, then it."""
        if self.rank == 0:
            header = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            header = torch.zeros(1, dtype=torch.int64)
        self._wait(self.control.broadcast([header], dist.BroadcastOptions()), "command header")
        body = payload.contiguous() if self.rank == 0 else torch.empty(int(header[0]), dtype=torch.int64)
        self._wait(self.control.broadcast([body], dist.BroadcastOptions()), "command")
        return body

    def barrier(self) -> None:
        self._wait(self.control.allreduce([torch.zeros(1)]), "barrier")

    def close(self) -> None:
        """Destroys the two groups now, while the interpreter runs: their destructors release the GIL and join gloo's
        threads. Left to interpreter shutdown, a gloo thread still freeing the last command's tensors (it needs the
        GIL) was ended by the finalizing interpreter inside C++ code: `terminate called without an active
        exception`, exit status -6, in about a quarter of a torchrun-launched rank 0's exits."""
        self.failed = self.failed or "the mesh was closed"
        self.control = self.data = None


class ThreadMesh:
    """The single-process mesh: `world_size` ranks as threads of one process, their tensors on one device, each
    collective a barrier and a local reduction. Every rank computes the same result in the same (rank) order."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Tensor | None] = [None] * world_size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def abort(self) -> None:
        """A rank failed: every rank waiting in a collective gets CommError now, not at the timeout."""
        self.barrier.abort()

    def reset(self) -> None:
        self.barrier.reset()
        self.slots = [None] * self.world_size

    def exchange(self, rank: int, x: Tensor) -> list[Tensor]:
        try:
            self.slots[rank] = x
            self.barrier.wait()
            parts = list(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        except threading.BrokenBarrierError:
            raise CommError(f"rank {rank}: another rank of the single-process mesh failed or did not arrive within "
                            f"{self.timeout:g} s") from None
        return parts


class ThreadComm:
    """One thread-rank of a ThreadMesh; `gather_parts` lets a fused kernel reduce the ranks' rows itself."""

    def __init__(self, mesh: ThreadMesh, rank: int) -> None:
        self.mesh, self.rank, self.world_size = mesh, rank, mesh.world_size

    def all_reduce(self, x: Tensor) -> Tensor:
        parts = self.mesh.exchange(self.rank, x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def gather_parts(self, x: Tensor) -> Tensor:
        """[ranks, ...]: every rank's x stacked (the Triton all_reduce_add_rms_norm reduces them in one launch)."""
        return torch.stack(self.mesh.exchange(self.rank, x.contiguous()))

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        return torch.cat(self.mesh.exchange(self.rank, x), dim=dim)

    def all_gather_rows(self, x: Tensor, counts: list[int]) -> Tensor:
        return torch.cat(self.mesh.exchange(self.rank, x), dim=0)

    def reduce_scatter_rows(self, x: Tensor, counts: list[int]) -> Tensor:
        start = _rows_offset(counts, self.rank)
        return self.all_reduce(x)[start:start + counts[self.rank]]

    def all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        parts = self.mesh.exchange(self.rank, x.split(send))
        return torch.cat([p[self.rank] for p in parts], dim=0)
