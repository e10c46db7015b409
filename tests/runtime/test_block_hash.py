"""Prefix-cache block keys (runtime/block_hash.py): collision resistant, the same in every process (a router and
its cores), salted by the LoRA adapter and the request's cache_salt, and carried by msgpack (kv events)."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from array import array

import msgspec
import pytest
from kiln.runtime import block_hash
from kiln.runtime.block_hash import block_hashes, hash_block, root_hash
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.prefix_cache import PrefixCache
from kiln.runtime.core.sequence import Sequence
from kiln.runtime.disagg.router import ReplicaIndex
from kiln.runtime.errors import RequestError
from kiln.runtime.ipc import protocol
from kiln.runtime.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def _seq(tokens: list[int], params: SamplingParams | None = None, lora_id: int | None = None) -> Sequence:
    n = next(_ids)
    seq = Sequence(seq_id=n, request_id=str(n), index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                   params=params or SamplingParams(), max_tokens=16, arrival=n)
    seq.lora_id = lora_id
    return seq


def _prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admits `seq` (taking its prefix hits), computes its prompt, publishes its full blocks; returns the hits."""
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return hits


def test_a_forced_collision_of_the_fast_hash_shares_no_block(monkeypatch):
    """The old keys were `hash((parent, tuple(ids)))`: make that collide for every block (as a crafted prompt
    would for one) and a second request with other tokens must still get no hit on the first's blocks."""
    monkeypatch.setattr(block_hash, "hash", lambda _: 0x6B696C6E, raising=False)  # shadows the builtin
    bm = BlockManager(num_blocks=16, block_size=BS, prefix_cache=PrefixCache())
    victim, probe = _seq(list(range(100, 109))), _seq(list(range(200, 209)))
    assert _prefill(bm, victim) == []
    assert _prefill(bm, probe) == []  # the old scheme: both of the victim's blocks came back
    assert bm.prefix_cache.hits == 0
    assert len(set(victim.block_hashes + probe.block_hashes)) == 4
    again = _seq(list(range(100, 109)))
    assert _prefill(bm, again) == victim.block_table[:2]  # the cache still works


def test_keys_are_128_bit_digests_of_the_parent_and_the_tokens():
    root = root_hash()
    keys = block_hashes(list(range(10)), BS, [])
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    # an independent computation of the documented encoding: parent digest, then the ids as little-endian int64
    ids = array("q", [0, 1, 2, 3])
    if sys.byteorder != "little":
        ids.byteswap()
    want = hashlib.sha256(root + ids.tobytes()).digest()[:16]
    assert keys[0] == want == hash_block(root, [0, 1, 2, 3])
    assert keys[1] == hash_block(keys[0], [4, 5, 6, 7])


def test_extending_known_keys_equals_hashing_from_scratch():
    tokens = [7, 3, 9, 1, 0, 2, 5, 5, 8, 4, 6, 2, 1]
    known: list[bytes] = []
    for n in range(len(tokens) + 1):
        block_hashes(tokens[:n], BS, known, lora_id=2, cache_salt="s")
        assert known == block_hashes(tokens[:n], BS, [], lora_id=2, cache_salt="s")
    assert len(known) == 3


def test_adapter_and_salt_each_start_a_chain_of_their_own():
    tokens = list(range(8))
    chains = {(lora, salt): block_hashes(tokens, BS, [], lora_id=lora, cache_salt=salt)[0]
              for lora in (None, 1, 2) for salt in (None, "a", "b", "\x01")}
    assert len(set(chains.values())) == len(chains)
    assert block_hashes(tokens, BS, [], cache_salt="a") == block_hashes(tokens, BS, [], cache_salt="a")
    assert block_hashes(tokens, BS, [], lora_id=1) == block_hashes(tokens, BS, [], lora_id=1)


def test_a_token_id_past_int64_is_a_request_error():
    with pytest.raises(RequestError, match="64-bit"):
        block_hashes([2**63] * BS, BS, [])


_CHILD = """
import json, sys
from kiln.runtime.block_hash import block_hashes
tokens = list(range(1000, 1013))
print(json.dumps([[k.hex() for k in block_hashes(tokens, 4, [], lora_id=lora, cache_salt=salt)]
                  for lora, salt in ((None, None), (3, None), (None, "tenant-\u00e4"), (3, "tenant-\u00e4"))]))
"""


def test_keys_are_the_same_in_every_process():
    """A router and its cores are other processes, with other str-hash seeds (the LoRA root hashed a string)."""
    tokens = list(range(1000, 1013))
    here = [[k.hex() for k in block_hashes(tokens, 4, [], lora_id=lora, cache_salt=salt)]
            for lora, salt in ((None, None), (3, None), (None, "tenant-ä"), (3, "tenant-ä"))]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120,
                             check=True).stdout
        assert json.loads(out) == here
    assert len({chain[0] for chain in here}) == 4


def test_kv_events_carry_the_keys_and_the_router_matches_them():
    """The cores' kv_events answer (a utility result, msgpack) reaches the router's index intact."""
    cache = PrefixCache()
    cache.record_events()
    salted = block_hashes(list(range(12)), BS, [], cache_salt="t1")
    for block, key in enumerate(salted):
        cache.insert(key, block)
    wire = protocol.encode(protocol.UtilityResult(1, {"events": cache.take_events()}))
    answer = msgspec.msgpack.decode(wire, type=protocol.UtilityResult).result
    index = ReplicaIndex()
    index.apply(answer)
    assert index.match(block_hashes(list(range(12)), BS, [], cache_salt="t1")) == 3
    assert index.match(block_hashes(list(range(12)), BS, [], cache_salt="t2")) == 0
    assert index.match(block_hashes(list(range(12)), BS, [])) == 0
    full = protocol.encode(protocol.UtilityResult(2, {"full": cache.cached_hashes()}))
    index.apply(msgspec.msgpack.decode(full, type=protocol.UtilityResult).result)
    assert index.reported == set(salted)
