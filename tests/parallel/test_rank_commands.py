"""The step commands rank 0 broadcasts to the other ranks: what `encode` makes decodes back exactly; anything else
(an unknown command, a count that is negative or runs past the end, ints left over) is CommandError, an
ExecutorError, never a partly read command; a worker given one exits at once (rank 0's executor then fails the
mesh with that exit) instead of running a guess whose collectives would leave rank 0 waiting for its timeout."""
from __future__ import annotations

import threading

import pytest
import torch
from kiln.runtime.worker.distributed.commands import (
    LORA_LOAD,
    Cmd,
    CommandError,
    RankState,
    decode,
    encode,
    lora_command_ints,
)
from kiln.runtime.worker.distributed.executor import worker_loop
from kiln.runtime.worker.interface import ExecutorError, HostBatch


def _batch(n: int) -> HostBatch:
    return HostBatch(list(range(n)), list(range(n)), [0, n], [n], [[3, 4]], list(range(10, 10 + n)), [n - 1], 0,
                     [n, 1], [1, 1])


def test_what_encode_makes_decodes_back():
    batches = [_batch(3), _batch(5)]
    cmd, ints, out = decode(encode(Cmd.EXECUTE, [1, 7], batches))
    assert cmd is Cmd.EXECUTE and ints == [1, 7] and out == batches
    assert decode(encode(Cmd.STOP)) == (Cmd.STOP, [], [])


def _malformed() -> dict[str, list[int]]:
    good = encode(Cmd.EXECUTE, [1, 7], [_batch(3)]).tolist()
    return {"empty": [], "unknown command": [99, 0, 0], "negative ints": [2, -1, 0], "ints past the end": [2, 50, 1],
            "no batch count": [2, 0], "negative batches": [2, 0, -2], "truncated batch": good[:-1],
            "ints left over": good + [0], "negative tokens": good[:5] + [-3] + good[6:]}


@pytest.mark.parametrize("kind", list(_malformed()))
def test_a_malformed_command_is_a_clear_executor_error(kind):
    with pytest.raises(CommandError, match="malformed step command") as info:
        decode(torch.tensor(_malformed()[kind], dtype=torch.int64))
    assert isinstance(info.value, ExecutorError)


class _Comm:
    rank = 1

    def __init__(self, payload: list[int]) -> None:
        self.payload = payload

    def broadcast_command(self, _):
        return torch.tensor(self.payload, dtype=torch.int64)


class _State:
    def handle(self, *args):
        raise AssertionError("a malformed command was run")


def test_a_worker_given_a_malformed_command_exits_at_once():
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", worker_loop(_State(), _Comm([99, 0, 0]))), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and out["rc"] == 3


def test_a_lora_load_whose_texts_do_not_decode_still_joins_the_count():
    """Rank 1 given a LORA load whose name is not UTF-8 counts itself failed and joins the all_reduce (without
    which rank 0 would wait there for the mesh timeout)."""
    reduced = []

    class Comm:
        rank = 1

        def all_reduce(self, flag):
            reduced.append(float(flag.item()))
            return flag

    class Lora:
        def load(self, *args, **kw):
            raise AssertionError("nothing to load")

    state = type("S", (), {"comm": Comm(), "lora": Lora(), "artifact": type("A", (), {"device": "cpu"})()})()
    ints = lora_command_ints(LORA_LOAD, 4, "x", "/p")
    ints[3] = 0xFF  # the name's one byte: not UTF-8
    assert RankState._lora_command(state, ints) == 1
    assert reduced == [1.0]
