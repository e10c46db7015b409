"""The CPU offload tier (runtime/core/kv_offload.py) on a tensor-parallel mesh: every rank keeps its own slice of the same
blocks in host memory, in lockstep with rank 0's decisions.

Rank 0 runs the tier's bookkeeping (core/kv_offload.py's `MeshOffloadTier`: which block hash is in which host slot, the LRU, the
leases and digests of restores, all on rank 0's block manager and ledger, as on one device); every rank, rank 0
included, holds a `HostKV` of the same slots shaped like its own slice of a block. The copies are KV_OFFLOAD
commands (commands.py) every rank runs in the order rank 0 sends them:

  saves     a block the prefix cache evicted, copied device -> host slot. Queued by rank 0 at the eviction (inside
            the scheduler's allocation) and sent ahead of the next command: nothing writes into the pool but a
            command, so every rank copies the block before anything overwrites it.
  loads     a restore: host slot -> the block rank 0 leased. Each rank reports, per block, the digest of its slice
            as saved (taken on its own thread at the save) and of what it copied; rank 0 gathers them
            (one all_gather of 16-byte digests) and feeds the ledger the digest of every rank's digests in rank
            order, both for what was saved (`expect`) and for what arrived (`end_write`). The lease commits only
            when they are equal, i.e. when every rank's slice checked out; otherwise the blocks go back to the pool
            and are recomputed.

A restore is synchronous: the command (the pending saves first, then the loads) runs on every rank while the
scheduler waits, and its lease commits or aborts before the scheduler goes on. Data-parallel attention is not
served: a block's KV is then on one rank only (the rank running its sequence, which the executor tracks), and a
restore would have to bring it back to the rank the returning sequence is placed on.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from ..host_kv import HostKV

logger = logging.getLogger(__name__)

OFFLOAD_ALLOCATE, OFFLOAD_COPY = 0, 1  # a KV_OFFLOAD command's first int
_DIGEST_INTS = 2  # a 16-byte BLAKE2b digest as two int64


def allocate_ints(num_blocks: int) -> list[int]:
    return [OFFLOAD_ALLOCATE, num_blocks]


def copy_ints(saves: list[int], loads: list[tuple[int, int]]) -> list[int]:
    """A KV_OFFLOAD copy: `saves` (flat device block, host slot pairs) run first, then `loads` (host slot, device
    block)."""
    out = [OFFLOAD_COPY, len(saves) // 2, *saves, len(loads)]
    for slot, block in loads:
        out += [slot, block]
    return out


def _digest_ints(digest: bytes) -> list[int]:
    return [int.from_bytes(digest[8 * i:8 * i + 8], "little", signed=True) for i in range(_DIGEST_INTS)]


def _ints_digest(ints: list[int]) -> bytes:
    return b"".join(int(i).to_bytes(8, "little", signed=True) for i in ints)


def offload_command(state: Any, ints: list[int]) -> list[tuple[bytes, bytes | None]] | int:
    """What a rank does with a KV_OFFLOAD command (commands.RankState). ALLOCATE: its HostKV of `ints[1]` slots
    over its KV pool (returns the number of ranks that could not). COPY: the saves, then the loads; returns, per
    load, the digest of every rank's slice as saved and as copied (digests of the ranks' digests in rank order; None
    as copied when a rank's copy failed)."""
    if ints[0] == OFFLOAD_ALLOCATE:
        return _allocate(state, ints[1])
    store: HostKV = state.host_kv
    n = ints[1]
    for j in range(n):
        try:
            store.save(ints[3 + 2 * j], ints[2 + 2 * j])
        except Exception as e:  # the slot holds no digest now: a restore from it fails (on every rank)
            logger.warning("rank %d: KV offload of block %d into host slot %d failed: %s: %s", state.comm.rank,
                           ints[2 + 2 * j], ints[3 + 2 * j], type(e).__name__, e)
    rest = ints[2 + 2 * n:]
    loads = [(rest[1 + 2 * j], rest[2 + 2 * j]) for j in range(rest[0])]
    if not loads:
        return []
    rows = []
    for slot, block in loads:
        try:
            saved, copied = store.saved_digest(slot), store.load(slot, block)
            rows.append([*_digest_ints(saved), *_digest_ints(copied), 1])
        except Exception as e:  # this rank's copy failed: the restore fails on every rank, the mesh goes on
            logger.warning("rank %d: KV offload restore of host slot %d into block %d failed: %s: %s",
                           state.comm.rank, slot, block, type(e).__name__, e)
            rows.append([0] * (2 * _DIGEST_INTS) + [0])
    local = torch.tensor(rows, dtype=torch.int64, device=state.artifact.device)
    every = state.comm.all_gather(local, dim=0).cpu().view(-1, len(loads), 2 * _DIGEST_INTS + 1).tolist()
    out = []
    for j in range(len(loads)):
        saved, copied = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        for rank_rows in every:
            saved.update(_ints_digest(rank_rows[j][:_DIGEST_INTS]))
            copied.update(_ints_digest(rank_rows[j][_DIGEST_INTS:2 * _DIGEST_INTS]))
        ok = all(rank_rows[j][-1] for rank_rows in every)
        out.append((saved.digest(), copied.digest() if ok else None))
    return out


def _allocate(state: Any, num_blocks: int) -> int:
    """Every rank allocates its host slots; returns how many ranks could not (summed over the mesh: where it is not
    0, every rank drops its slots again and rank 0 refuses the tier)."""
    failed = 0
    try:
        state.host_kv = HostKV(state.runner.kv_caches, num_blocks)
    except (RuntimeError, MemoryError) as e:
        logger.warning("rank %d: cannot allocate the KV offload tier's %d host blocks: %s", state.comm.rank,
                       num_blocks, e)
        failed = 1
    total = int(state.comm.all_reduce(torch.tensor([float(failed)], device=state.artifact.device)).item())
    if total:
        state.host_kv = None
    return total


__all__ = ["OFFLOAD_ALLOCATE", "OFFLOAD_COPY", "allocate_ints", "copy_ints", "offload_command"]
