"""A stream that lags behind the core gets the deltas waiting merged (RequestGroup.batches, streaming.merge_deltas):
same tokens and text in the same order, an error still raised after what came before it."""
from __future__ import annotations

import asyncio

import pytest
from kiln.runtime.api.async_engine import PromptInput, RequestGroup
from kiln.runtime.api.streaming import merge_deltas
from kiln.runtime.errors import KilnRuntimeError
from kiln.runtime.outputs import CompletionDelta, RequestDelta
from kiln.runtime.sampling_params import SamplingParams


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[list[str]] = []

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.append(sorted(request_ids))


def _delta(rid: str, text: str, ids: list[int], finished: bool = False, error: BaseException | None = None):
    return RequestDelta(rid, [CompletionDelta(0, text, ids, None, "length" if finished else None)], 3, finished,
                        error)


async def _collect(group: RequestGroup) -> list[list[RequestDelta]]:
    return [batch async for batch in group.batches()]


def _group(engine, ids):
    return RequestGroup(engine, [PromptInput(r, [1, 2, 3]) for r in ids], SamplingParams())


def test_waiting_deltas_come_as_one_batch_in_order():
    async def run():
        group = _group(_Engine(), ["a", "b"])
        for d in [_delta("a", "x", [1]), _delta("b", "y", [2]), _delta("a", "z", [3], True)]:
            group.queue.put_nowait(d)
        first = asyncio.ensure_future(_collect(group))
        await asyncio.sleep(0)
        group.queue.put_nowait(_delta("b", "w", [4], True))
        return await asyncio.wait_for(first, 5)

    batches = asyncio.run(run())
    assert [[(d.request_id, d.completions[0].text) for d in b] for b in batches] == [
        [("a", "x"), ("b", "y"), ("a", "z")], [("b", "w")]]


def test_an_error_comes_after_the_deltas_before_it():
    async def run():
        engine = _Engine()
        group = _group(engine, ["a", "b"])
        for d in [_delta("a", "x", [1]), _delta("b", "", [], True, KilnRuntimeError("boom")), _delta("a", "q", [9])]:
            group.queue.put_nowait(d)
        seen = []
        with pytest.raises(KilnRuntimeError, match="boom"):
            async for batch in group.batches():
                seen.append([d.completions[0].text for d in batch])
        return seen, engine.aborted

    seen, aborted = asyncio.run(run())
    assert seen == [["x"]] and aborted == [["a", "b"]]


def test_merge_concatenates_one_completions_deltas():
    a = CompletionDelta(0, "he", [1, 2], [{1: "lp1"}, {2: "lp2"}])
    b = CompletionDelta(0, "llo", [3], [{3: "lp3"}], "stop", 7)
    m = merge_deltas(a, b)
    assert (m.text, m.token_ids, m.logprobs, m.finish_reason, m.stop_reason) == (
        "hello", [1, 2, 3], [{1: "lp1"}, {2: "lp2"}, {3: "lp3"}], "stop", 7)
    assert merge_deltas(CompletionDelta(0, "a", [1], None), CompletionDelta(0, "b", [2], None)).logprobs is None
    assert (a.text, a.token_ids) == ("he", [1, 2])  # the parts are not changed
