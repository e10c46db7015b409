"""Output identity: a prefill core + a decode core (KV pushed over a transport) produce the token ids of one
co-located core, greedy fp32, for prompts below one block, exactly k blocks, k blocks + 1 and long, with and
without a decode-side prefix hit. At concurrency 1 the logprobs are bit-equal to a co-located core that splits
the prompt's forward the same way (chunks [0, L-1) and [L-1, L): the decode core computes the last prompt token
in a forward of its own), and within fp32 rounding (1e-5) of one whole-prompt forward."""
from __future__ import annotations

import random

import pytest
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.disagg.plugins import connect, make_receiver
from kiln.runtime.disagg.transport import KVLayout
from kiln.runtime.sampling_params import SamplingParams
from pair import Pair, collect, run_colocated

BS = 4  # the stand-in artifact's block size
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1, 3 * BS - 1, 5 * BS, 60, 97]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine(artifact_dir, **kw) -> EngineCore:
    return EngineCore(artifact_dir, num_kv_blocks=kw.pop("num_kv_blocks", 256), **kw)


@pytest.fixture(scope="module")
def reference(artifact_dir):
    eng = engine(artifact_dir)
    ps = prompts(eng.limits.vocab_size)
    out = {}
    for i, p in enumerate(ps):  # concurrency 1
        out.update({f"r{i}": v for v in run_colocated(eng, [p], GREEDY).values()})
    return ps, out


@pytest.fixture(scope="module")
def split_reference(artifact_dir, reference):
    """Co-located, each prompt's forward split as the disaggregated pair splits it: chunk L-1, then 1."""
    ps, _ = reference
    eng = engine(artifact_dir, prefix_cache=None)
    out = {}
    for i, p in enumerate(ps):
        eng.scheduler._chunk = max(1, len(p) - 1)
        out.update({f"r{i}": v for v in run_colocated(eng, [p], GREEDY).values()})
    return out


def assert_same(got, ref, exact_logprobs: bool, close_logprobs: bool = False) -> None:
    assert set(got) == set(ref)
    for r in ref:
        assert got[r][0] == ref[r][0], f"{r}: tokens {got[r][0]} != co-located {ref[r][0]}"
        assert got[r][2] == ref[r][2]
        if exact_logprobs:
            assert got[r][1] == ref[r][1], f"{r}: logprobs differ"
        if close_logprobs:
            assert len(got[r][1]) == len(ref[r][1]) == GREEDY.max_tokens
            assert max(abs(a - b) for a, b in zip(got[r][1], ref[r][1])) < 1e-5, f"{r}: logprobs differ"


def test_identity_concurrency_one(artifact_dir, reference, split_reference):
    ps, ref = reference
    pair = Pair(engine(artifact_dir), engine(artifact_dir))
    got = {}
    for i, p in enumerate(ps):
        got.update({f"r{i}": v for v in pair.run([p], GREEDY).values()})
    assert_same(got, ref, exact_logprobs=False, close_logprobs=True)
    assert_same(got, split_reference, exact_logprobs=True)
    d = pair.decode_role.decisions
    assert d["remote"] == sum(1 for p in ps if len(p) > 1), d  # every prompt but the 1-token one went remote
    assert pair.decode_role.pending == {} and pair.decode_role.ledger.leases == {}
    states = pair.decode_role.check()
    assert states["leased"] == 0 and states["active"] == 0


def test_identity_batched_and_with_decode_prefix_hit(artifact_dir, reference):
    ps, ref = reference
    pair = Pair(engine(artifact_dir), engine(artifact_dir))
    got = {}
    for r, v in pair.run(ps, GREEDY).items():
        got[r] = v
    assert_same(got, ref, exact_logprobs=False)
    # Again: now the decode core's prefix cache holds every prompt's full blocks; only the rest is transferred.
    hits_before = pair.decode.block_manager.prefix_cache.hits
    sent_before = pair.prefill_role.bytes_sent
    again = pair.run(ps, GREEDY)
    assert_same(again, ref, exact_logprobs=False)
    assert pair.decode.block_manager.prefix_cache.hits > hits_before
    long_blocks = (97 - 1) // BS + (60 - 1) // BS  # a long prompt now sends at most its partial tail block
    assert pair.prefill_role.bytes_sent - sent_before < (long_blocks * pair.decode_role.layout.block_bytes)
    assert pair.decode_role.decisions["local:nothing_to_transfer"] >= 1
    pair.decode_role.check()


def test_conditional_local_prefill_keeps_identity(artifact_dir, reference):
    """Prompts with fewer than `min_remote_tokens` tokens to compute past the decode core's hit prefill there."""
    ps, ref = reference
    pair = Pair(engine(artifact_dir), engine(artifact_dir))
    for i, p in enumerate(ps):
        pair.add(f"r{i}", p, GREEDY, min_remote_tokens=2 * BS)
    assert_same(collect(pair.decode, pair.pump), ref, exact_logprobs=False)
    d = pair.decode_role.decisions
    assert d["local:short_prompt"] == sum(1 for p in ps if 2 <= len(p) <= 2 * BS), d  # 1..7 tokens to send
    assert d["remote"] == sum(1 for p in ps if len(p) > 2 * BS), d
    assert pair.decode_role.ledger.leases == {} and pair.decode_role.check()["leased"] == 0


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_identity_over_a_real_transport(artifact_dir, reference, kind):
    ps, ref = reference
    receiver = make_receiver(kind, KVLayout.of(engine(artifact_dir, num_kv_blocks=1)).block_bytes)
    sender = connect(receiver.endpoint)
    pair = Pair(engine(artifact_dir), engine(artifact_dir), transport=sender, receiver=receiver, threaded=True)
    try:
        real_poll = pair.decode_role.poll
        pair.decode_role.poll = lambda timeout=0.0: real_poll(0.002)  # frames cross a real socket
        got = pair.run(ps, GREEDY)
        assert_same(got, ref, exact_logprobs=False)
        assert pair.decode_role.decisions["remote"] == len(ps) - 1
        assert pair.decode_role.ledger.counts["succeeded"] == len(ps) - 1, pair.decode_role.decisions  # no fallback
        pair.decode_role.check()
    finally:
        pair.prefill_role.close()  # its sender thread, and the sending end it used
        receiver.close()


def test_layouts_must_match(artifact_dir, artifact_copy=None):
    from kiln.runtime.disagg.roles import PrefillRole
    from kiln.runtime.disagg.transport import DisaggError, KVLayout, RemotePrefill
    eng = engine(artifact_dir)
    role = PrefillRole(eng, lambda e: None, threaded=False)
    other = KVLayout(3, [4, 2, 2, 16], "float32", 4)
    with pytest.raises(DisaggError, match="KV layouts differ"):
        role.add("t", [5, 6, 7], RemotePrefill("t", 3, 0, [0], [1], other))
    assert not eng.has_unfinished_requests()


def test_cores_with_other_weights_refuse_to_pair(artifact_dir):
    """Same KV layout, other weight files (another fine-tune, other fp8 scales): refused at the handshake."""
    import dataclasses
    import json

    import msgspec
    from kiln.runtime.disagg.roles import PrefillRole
    from kiln.runtime.disagg.transport import DisaggError, KVLayout, RemotePrefill
    eng = engine(artifact_dir)
    role = PrefillRole(eng, lambda e: None, threaded=False)
    manifest = json.loads(json.dumps(eng.artifact.manifest))
    first = next(iter(manifest["weights"]["sha256"]))
    manifest["weights"]["sha256"][first] = "0" * 64  # what a compile with other weights records
    fake = type("Engine", (), {"runner": eng.runner, "artifact": dataclasses.replace(eng.artifact, manifest=manifest)})
    other = KVLayout.of(fake())
    assert msgspec.structs.replace(other, weights_digest=role.layout.weights_digest) == role.layout
    with pytest.raises(DisaggError, match="other weights"):
        role.add("t", [5, 6, 7], RemotePrefill("t", 3, 0, [0], [1], other))
    assert not eng.has_unfinished_requests()
    assert KVLayout.of(eng) == role.layout  # the same artifact pairs
