"""Prefix-cache block keys: a hash chain over full token blocks, stable across processes, so the engine core's
prefix cache (core/prefix_cache.py) and the KV-aware router (disagg/router.py) compute the same keys."""
from __future__ import annotations

from collections.abc import Sequence as Seq

_ROOT_HASH = 0x6B696C6E  # parent of the first block: a fixed seed so hashes are stable across runs


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Key of a full block: depends on every token before it through `parent_hash` (a radix path, flattened)."""
    return hash((parent_hash, tuple(token_ids)))


def block_hashes(token_ids: Seq[int], block_size: int, known: list[int], lora_id: int | None = None) -> list[int]:
    """Extends `known` (the hashes already computed for this token list) to every full block; returns it.
    The chain of a sequence decoding with a LoRA adapter starts from a root of its own: the same tokens under
    another adapter (or none) have other K/V, so they never share a block."""
    parent = known[-1] if known else (_ROOT_HASH if lora_id is None else hash((_ROOT_HASH, "lora", lora_id)))
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        known.append(parent)
    return known
