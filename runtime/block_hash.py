"""Prefix-cache block keys: a hash chain over full token blocks, the same in every process, so the engine core's
prefix cache (core/prefix_cache.py), its KV offload tier (core/kv_offload.py) and the KV-aware router
(disagg/router.py, through the cores' kv events) compute the same keys.

A key is a SHA-256 digest cut to 16 bytes (`BlockHash`, bytes: msgpack carries it as is, unlike a 128-bit int) of
a canonical encoding: the parent's key and the block's token ids as little-endian int64s (SHA-256 rather than
BLAKE2b: OpenSSL's is the faster for blocks this small). A cache hit is trusted
without comparing tokens, so the key must be collision resistant: a crafted collision would let one request read
another's K/V (vLLM's CVE-2025-25183, against Python's `hash`). The root (parent of the first block) is keyed by
what else decides a block's K/V or who may share it: the LoRA adapter (the core's id of the loaded adapter) and
the request's `cache_salt` (requests with different salts never share a block). Nothing here depends on
PYTHONHASHSEED or the process."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq

from .errors import RequestError

BlockHash = bytes
DIGEST_SIZE = 16  # 128 bits: collisions cost ~2^64 work
_ROOT_TAG = b"kiln.prefix.root"  # 16 bytes, where a block's preimage has its parent's digest


def root_hash(lora_id: int | None = None, cache_salt: str | None = None) -> BlockHash:
    """Parent of a chain's first block: the base model or LoRA adapter `lora_id`, unsalted or `cache_salt`.
    Encoded as a flag byte and int64 for the adapter, then a flag byte and the salt's UTF-8 (the rest)."""
    data = (b"\x01" + struct.pack("<q", lora_id) if lora_id is not None else b"\x00") + \
        (b"\x01" + cache_salt.encode("utf-8", "surrogatepass") if cache_salt is not None else b"\x00")
    return hashlib.sha256(_ROOT_TAG + data).digest()[:DIGEST_SIZE]


_BASE_ROOT = root_hash()


def _token_bytes(token_ids: Seq[int]) -> bytes:
    """The ids as little-endian int64s, whatever the machine (struct: several times faster than an array)."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error:
        raise RequestError("prompt token ids must be 64-bit integers") from None


def hash_block(parent_hash: BlockHash, token_ids: Seq[int]) -> BlockHash:
    """Key of a full block: depends on every token before it through `parent_hash` (a radix path, flattened)."""
    return hashlib.sha256(parent_hash + _token_bytes(token_ids)).digest()[:DIGEST_SIZE]


def block_hashes(token_ids: Seq[int], block_size: int, known: list[BlockHash], lora_id: int | None = None,
                 cache_salt: str | None = None) -> list[BlockHash]:
    """Extends `known` (the hashes already computed for this token list) to every full block; returns it.
    The chain of a sequence decoding with a LoRA adapter, or salted, starts from a root of its own: the same
    tokens under another adapter (or none) have other K/V, and another salt is another tenant, so they never
    share a block. One bytes buffer is packed for all the new blocks, and each block hashes a slice of it."""
    start = len(known) * block_size
    end = start + (len(token_ids) - start) // block_size * block_size
    if end <= start:
        return known
    parent = known[-1] if known else (_BASE_ROOT if lora_id is None and cache_salt is None
                                      else root_hash(lora_id, cache_salt))
    buf = _token_bytes(token_ids[start:end])
    width, sha256 = block_size * 8, hashlib.sha256
    for offset in range(0, len(buf), width):
        parent = sha256(parent + buf[offset:offset + width]).digest()[:DIGEST_SIZE]
        known.append(parent)
    return known
