"""The fault matrix of an in-process prefill/decode pair: every injector fault (drop, delay, duplicate, reorder,
corrupt, close), aborts before / during / after a transfer and after finish, late and duplicate completions, and a
stale transfer's frames replayed into blocks a new transfer leased. After each: every request ended, with the
co-located tokens (a failed transfer falls back to a decode-side prefill, so no request is answered from KV that
is not its own), no lease left, free + active + leased + cached == total on the decode side, and the prefill
side's blocks all reusable."""
from __future__ import annotations

import random
import time

import pytest
from kiln.runtime.core.engine import EngineCore
from kiln.runtime.disagg.transport import (
    DoneFrame,
    FaultInjector,
    Faults,
    InProcTransport,
    decode,
    encode,
)
from kiln.runtime.sampling_params import SamplingParams
from pair import Pair, collect, run_colocated

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LEASE_S = 0.5
BOUND_S = 20.0  # every run below ends well within this on a loaded 2-core machine (lease + compute)


def engine(artifact_dir, **kw) -> EngineCore:
    return EngineCore(artifact_dir, num_kv_blocks=kw.pop("num_kv_blocks", 128), **kw)


@pytest.fixture(scope="module")
def cases(artifact_dir):
    eng = engine(artifact_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, eng.limits.vocab_size) for _ in range(n)] for n in (3, 4, 5, 9, 17, 40)]
    ref = {}
    for i, p in enumerate(prompts):
        ref.update({f"r{i}": v[0] for v in run_colocated(eng, [p], GREEDY).values()})
    return prompts, ref


@pytest.fixture(scope="module")
def engines(artifact_dir):
    return engine(artifact_dir), engine(artifact_dir)


def fresh_pair(engines, transport, receiver=None) -> Pair:
    prefill, decode = engines
    for eng in engines:
        assert not eng.has_unfinished_requests()
        eng.block_manager.prefix_cache.reset()  # a cold start for each case (no hits left from the last)
        bm = eng.block_manager
        bm._free.clear()
        bm._free.extend(range(bm.num_blocks))
    return Pair(prefill, decode, transport, receiver, lease_s=LEASE_S)


def check_clean(pair: Pair) -> None:
    role = pair.decode_role
    assert role.pending == {} and role.ledger.leases == {}, "a lease outlived its request"
    states = role.check()
    assert states["leased"] == 0 and states["active"] == 0, states
    assert pair.prefill.block_manager.num_free_blocks == pair.prefill.block_manager.num_blocks
    assert not pair.decode.has_unfinished_requests() and not pair.prefill.has_unfinished_requests()


def run_all(pair: Pair, prompts, after_pump=None) -> dict:
    start = time.monotonic()
    for i, p in enumerate(prompts):
        pair.add(f"r{i}", p, GREEDY)

    def between():
        pair.pump()
        if after_pump:
            after_pump()
        assert time.monotonic() - start < BOUND_S, "a request did not end within the bound"
        if pair.decode_role.pending and not (pair.decode.scheduler.running or pair.decode.scheduler.waiting):
            time.sleep(0.01)  # only transfers outstanding: let leases run out

    out = collect(pair.decode, between, max_steps=100_000)
    return {r: v[0] for r, v in out.items()}


@pytest.mark.parametrize("fault", [
    Faults(drop=0.3), Faults(delay=0.4), Faults(duplicate=0.5), Faults(reorder=0.5), Faults(corrupt=0.3),
    Faults(close_after=7), Faults(drop=0.1, delay=0.2, duplicate=0.2, reorder=0.2, corrupt=0.1),
], ids=["drop", "delay", "duplicate", "reorder", "corrupt", "close", "mixed"])
def test_injected_faults(engines, cases, fault):
    prompts, ref = cases
    inner = InProcTransport()
    injector = FaultInjector(inner, fault, seed=7)
    pair = fresh_pair(engines, injector, receiver=inner)
    got = run_all(pair, prompts)
    assert got == ref
    injector.flush()  # late frames, after their transfers ended: refused, nothing changes
    pair.decode_role.poll()
    check_clean(pair)
    assert injector.log or fault.close_after is not None, "the injector injected nothing"
    if fault.drop or fault.corrupt or fault.close_after is not None:
        assert pair.decode_role.fallbacks, pair.decode_role.decisions
    assert sum(pair.decode_role.decisions.values()) == len(prompts), pair.decode_role.decisions  # one per request


class Recorder(InProcTransport):
    """Holds the prefill side's frames until the test delivers them."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)


def test_abort_before_during_after_and_after_finish(engines, cases):
    prompts, ref = cases
    rec, receiver = Recorder(), InProcTransport()
    pair = fresh_pair(engines, rec, receiver)
    long_prompt = prompts[-1]
    # before: reserved, nothing sent
    desc = pair.add("a", long_prompt, GREEDY)
    assert desc is not None and len(desc.block_ids) > 3
    pair.decode.abort_request("a")
    pair.decode.abort_request("a")  # idempotent
    assert pair.decode_role.ledger.leases == {}
    pair.prefill_role.abort(desc.transfer_id)
    assert rec.frames and decode(rec.frames[-1]).__class__.__name__ == "FailFrame"
    # during: half of the blocks written, then the client goes away
    rec.frames.clear()
    desc = pair.add("b", long_prompt, GREEDY)
    while pair.prefill.has_unfinished_requests():
        pair.prefill.step()
    frames = list(rec.frames)
    for f in frames[:len(frames) // 2]:
        receiver.send(f)
    pair.decode_role.poll()
    assert pair.decode_role.ledger.leases[desc.transfer_id].digests
    pair.decode.abort_request("b")
    for f in frames[len(frames) // 2:]:  # the rest arrives late
        receiver.send(f)
    pair.decode_role.poll()
    check_clean(pair)
    # after the commit (decoding) and after finish
    rec.frames.clear()
    desc = pair.add("c", long_prompt, GREEDY)
    while pair.prefill.has_unfinished_requests():
        pair.prefill.step()
    for f in rec.frames:
        receiver.send(f)
    pair.decode_role.poll()
    assert "c" in pair.decode.requests and not pair.decode_role.pending
    pair.decode.step()
    pair.decode.abort_request("c")  # while decoding
    pair.decode_role.abort(desc.transfer_id)  # the router's abort after the transfer: a no-op
    for f in rec.frames:  # duplicate frames and a duplicate Done after the commit
        receiver.send(f)
    pair.decode_role.poll()
    check_clean(pair)
    got = run_all(pair, [long_prompt])
    assert got["r0"] == ref[f"r{len(prompts) - 1}"]
    pair.decode.abort_request("r0")  # after finish
    pair.decode_role.abort("nonexistent")
    check_clean(pair)


def test_stale_frames_never_land_in_reused_blocks(artifact_dir, engines, cases):
    """Transfer A is aborted after its prefill sent everything; B leases the same blocks (a pool just big enough
    for B); A's frames (and A's Done) replayed before B's must change nothing B answers."""
    prompts, ref = cases
    rec, receiver = Recorder(), InProcTransport()
    pair = fresh_pair((engines[0], engine(artifact_dir, num_kv_blocks=12)), rec, receiver)
    other = prompts[-2]  # A: another prompt, so A's KV in B's blocks would change B's tokens
    desc_a = pair.add("a", other, GREEDY)
    while pair.prefill.has_unfinished_requests():
        pair.prefill.step()
    stale = list(rec.frames)
    pair.decode.abort_request("a")
    rec.frames.clear()
    target = prompts[-1]
    desc_b = pair.add("r0", target, GREEDY)
    assert set(desc_b.block_ids) & set(desc_a.block_ids), "B did not reuse A's blocks: the test proves nothing"
    # A's frames retargeted to B's transfer id cannot pass either: the digest binds transfer, index, generation
    forged = [encode(DoneFrame(desc_b.transfer_id, decode(stale[-1]).digests[:len(desc_b.block_ids)]))]
    for f in stale + forged:
        receiver.send(f)
    pair.decode_role.poll()
    lease = pair.decode_role.ledger.leases.get(desc_b.transfer_id)
    assert lease is None or not lease.digests  # nothing of A's was written into B's blocks
    replayed_blocks = pair.decode_role.num_bad_frames
    assert replayed_blocks >= len(desc_a.block_ids)

    def forward():  # B's own frames, as its prefill sends them
        pair.pump()
        while rec.frames:
            receiver.send(rec.frames.pop(0))
    got = {r: v[0] for r, v in collect(pair.decode, forward).items()}
    assert got["r0"] == ref[f"r{len(prompts) - 1}"]
    check_clean(pair)
