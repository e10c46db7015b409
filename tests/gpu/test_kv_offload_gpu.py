"""The CPU offload tier over a CUDA KV pool (runtime/core/kv_offload.py): host slots are pinned, a block offloaded from
the device and restored into another device block holds the same bytes, and a later offload into the reused host
slot (a device-to-host copy, ordered on the stream after the restore's host-to-device copy) does not change it."""
from __future__ import annotations

import torch
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.kv_offload import OffloadTier
from kiln.runtime.core.prefix_cache import PrefixCache


def _publish_and_evict(bm: BlockManager, kv: list[torch.Tensor], block_hash: int) -> torch.Tensor:
    b = bm._take_free_block()
    for layer in kv:
        layer[b] = torch.randn(layer.shape[1:], device=layer.device)
    bm.prefix_cache.insert(block_hash, b)
    bm.unpin([b])
    content = torch.stack([layer[b].clone() for layer in kv])
    assert bm.prefix_cache.evict() == b  # offloaded now
    for layer in kv:
        layer[b] = 0.0
    bm._free.append(b)
    return content


def test_offload_and_restore_on_cuda():
    kv = [torch.zeros((8, 2, 16, 2, 64), device="cuda") for _ in range(3)]
    bm = BlockManager(8, 16, PrefixCache())
    tier = OffloadTier(bm, kv, 1)
    assert all(h.is_pinned() for h in tier.host)
    first = _publish_and_evict(bm, kv, 1)
    (b,) = tier.restore([1], [])
    bm.pin([b])  # a sequence takes it, so the next eviction is another block's
    _publish_and_evict(bm, kv, 2)  # the one host slot is reused at once
    torch.cuda.synchronize()
    assert torch.equal(torch.stack([layer[b] for layer in kv]), first)
    tier.check()
