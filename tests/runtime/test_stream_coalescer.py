"""The engine core's stream coalescer (`kiln serve --stream-interval N`): fewer, larger deltas, and nothing lost,
reordered or late (a stream's first tokens and its end go out in the step they are made)."""
from __future__ import annotations

import random

import pytest
from kiln.runtime.core.process import StreamCoalescer
from kiln.runtime.ipc.protocol import SeqDelta


def _steps(seed: int) -> list[list[SeqDelta]]:
    """Steps of 5 requests (one with n=2): 1-3 tokens a step (speculative steps add several), logprobs on one
    request, endings by length, stop and error at different steps."""
    rng = random.Random(seed)
    lengths = {("a", 0): 17, ("b", 0): 1, ("c", 0): 9, ("c", 1): 23, ("d", 0): 30, ("e", 0): 12}
    made = dict.fromkeys(lengths, 0)
    steps = []
    for _ in range(40):
        step = []
        for (rid, idx), n in lengths.items():
            if made[rid, idx] >= n:
                continue
            k = min(rng.randint(1, 3), n - made[rid, idx])
            ids = [rng.randrange(1000) for _ in range(k)]
            made[rid, idx] += k
            end = made[rid, idx] >= n
            reason = {"e": "error", "b": "stop"}.get(rid, "length") if end else None
            step.append(SeqDelta(rid, idx, ids, [([t], [-0.5], [1]) for t in ids] if rid == "a" else None,
                                 finish_reason=reason, error="boom" if reason == "error" else None))
        steps.append(step)
    return steps


def _by_stream(deltas: list[SeqDelta]) -> dict[tuple[str, int], list[SeqDelta]]:
    out: dict[tuple[str, int], list[SeqDelta]] = {}
    for d in deltas:
        out.setdefault((d.request_id, d.index), []).append(d)
    return out


@pytest.mark.parametrize("interval", [2, 3, 8])
def test_coalesced_streams_carry_every_token_in_order(interval: int):
    steps = _steps(seed=interval)
    sent_steps = []  # what the coalescer let out, step by step
    coalescer = StreamCoalescer(interval)
    for step in steps:
        sent_steps.append(coalescer([SeqDelta(d.request_id, d.index, list(d.token_ids), d.logprobs, None,
                                              d.finish_reason, d.stop_reason, d.error) for d in step]))
    made, sent = _by_stream([d for s in steps for d in s]), _by_stream([d for s in sent_steps for d in s])
    assert sent.keys() == made.keys()
    for key, ds in made.items():
        out = sent[key]
        assert [t for d in out for t in d.token_ids] == [t for d in ds for t in d.token_ids], key
        if key[0] == "a":
            assert [lp for d in out for lp in d.logprobs] == [lp for d in ds for lp in d.logprobs]
        assert [d.finish_reason is not None for d in out] == [False] * (len(out) - 1) + [True], key
        assert (out[-1].finish_reason, out[-1].error) == (ds[-1].finish_reason, ds[-1].error)
        assert all(len(d.token_ids) >= interval for d in out[1:-1]), [len(d.token_ids) for d in out]
    assert len(sent_steps) == len(steps) and coalescer.streams == {}  # every ended stream is forgotten
    for key in made:  # the first tokens and the end leave in the step that made them
        first = next(i for i, s in enumerate(steps) if any((d.request_id, d.index) == key for d in s))
        last = max(i for i, s in enumerate(steps) if any((d.request_id, d.index) == key for d in s))
        assert any((d.request_id, d.index) == key for d in sent_steps[first])
        assert any((d.request_id, d.index) == key and d.finish_reason for d in sent_steps[last])
    assert sum(map(len, sent_steps)) < sum(map(len, steps))  # it did coalesce


def test_interval_1_passes_deltas_through_and_forget_drops_held_tokens():
    deltas = [SeqDelta("a", 0, [1]), SeqDelta("b", 0, [2])]
    assert StreamCoalescer(1)(deltas) is deltas
    coalescer = StreamCoalescer(4)
    assert [d.token_ids for d in coalescer(deltas)] == [[1], [2]]  # first tokens: at once
    assert coalescer([SeqDelta("a", 0, [3]), SeqDelta("b", 0, [4])]) == []  # held
    coalescer.forget(lambda request_id: request_id != "a")  # "a" was aborted
    out = coalescer([SeqDelta("b", 0, [5], finish_reason="length")])
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in out] == [("b", [4, 5], "length")]
    assert coalescer.streams == {}
    with pytest.raises(ValueError, match="at least 1"):
        StreamCoalescer(0)
