"""Host copies of KV blocks: the slots the CPU offload tier (core/kv_offload.py) saves evicted prefix-cache blocks
into, one per process holding a device pool (the engine core's, or each tensor-parallel rank's slice)."""
from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class HostKV:
    """One process's host copy of KV blocks: `num_blocks` slots shaped like a block of each of `kv_caches` (the
    device pool this process holds: the whole pool, or a tensor-parallel rank's slice of every block), pinned where
    CUDA is present, and the digest of each slot's content as saved, computed by a thread of its own. `save` and
    `load` copy at once; the slot bookkeeping (which block hash is where, LRU, who reads what) is `OffloadTier`'s."""

    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.kv_caches = kv_caches
        pin = kv_caches[0].device.type == "cuda"
        self.host = [torch.zeros((num_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin) for c in kv_caches]
        self.block_bytes = sum(h[0].numel() * h.element_size() for h in self.host)
        self._digest: dict[int, Future[bytes]] = {}  # host slot -> digest of its content when saved
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kiln-offload-digest")

    def save(self, slot: int, block_id: int) -> None:
        """Copies device block `block_id` into `slot`; its digest is computed off the caller's thread. A slot saved
        before is overwritten only once its pending digest was computed or cancelled (so the thread always reads
        what was saved)."""
        pending = self._digest.pop(slot, None)
        if pending is not None and not pending.cancel():
            pending.result()
        for host, dev in zip(self.host, self.kv_caches, strict=True):
            host[slot].copy_(dev[block_id])
        self._digest[slot] = self._hasher.submit(self._content_digest, slot)

    def saved_digest(self, slot: int) -> bytes:
        """The digest of what `slot` held when saved (waits for the thread)."""
        return self._digest[slot].result()

    def load(self, slot: int, block_id: int) -> bytes:
        """Copies `slot` into device block `block_id`; returns the digest of what the slot holds now."""
        for host, dev in zip(self.host, self.kv_caches, strict=True):
            dev[block_id].copy_(host[slot], non_blocking=True)
        return self._content_digest(slot)

    def _content_digest(self, slot: int) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for host in self.host:
            h.update(host[slot].view(torch.uint8).numpy())
        return h.digest()
