"""Scheduler: token budget, chunked prefill, decodes first, max_seqs, preemption order."""
from __future__ import annotations

import itertools

from kiln.runtime.config import SchedulerConfig
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.core.sequence import Sequence, SequenceStatus
from kiln.runtime.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(n_tokens: int) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(range(1, n_tokens + 1)),
                    num_prompt_tokens=n_tokens, params=SamplingParams(), max_tokens=64, arrival=i)


def make_scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_seqs": 8, "max_batched_tokens": 16, "chunked_prefill": 512, "policy": "fcfs",
                                "prefix_cache": None, "preemption": "recompute", "swap_space": 0,
                                "async_scheduling": None, **cfg})
    return Scheduler(config, BlockManager(num_blocks, block_size))


def step(sched: Scheduler):
    batch = sched.schedule()
    sampled = [7 if s.num_computed_tokens + n == s.num_tokens else None
               for s, n in zip(batch.seqs, batch.num_new_tokens)]
    sched.update(batch, sampled)
    return batch


def test_token_budget_splits_prefills():
    sched = make_scheduler(max_batched_tokens=16)
    seqs = [make_seq(10) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    b1 = step(sched)
    assert b1.seqs == seqs[:2] and b1.num_new_tokens == [10, 6] and b1.num_decodes == 0
    b2 = step(sched)
    # seq0 decodes (first), then seq1 finishes its prompt, then seq2 takes what is left
    assert b2.seqs == [seqs[0], seqs[1], seqs[2]] and b2.num_new_tokens == [1, 4, 10] and b2.num_decodes == 1
    assert b2.num_tokens <= 16
    b3 = step(sched)
    assert b3.num_decodes == 3 and b3.num_new_tokens == [1, 1, 1]


def test_chunked_prefill_caps_each_sequence():
    sched = make_scheduler(max_batched_tokens=100, chunked_prefill=4)
    a, b = make_seq(10), make_seq(3)
    sched.add(a)
    sched.add(b)
    assert step(sched).num_new_tokens == [4, 3]
    batch = step(sched)
    assert batch.seqs == [b, a] and batch.num_new_tokens == [1, 4] and batch.num_decodes == 1
    batch = step(sched)
    assert batch.seqs == [b, a] and batch.num_new_tokens == [1, 2]
    assert a.num_computed_tokens == 10 and a.num_tokens == 11


def test_max_seqs_limits_running():
    sched = make_scheduler(max_seqs=2, max_batched_tokens=100)
    seqs = [make_seq(3) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    assert step(sched).seqs == seqs[:2]
    assert seqs[2].status is SequenceStatus.WAITING
    sched.finish(seqs[0])
    assert step(sched).seqs == [seqs[1], seqs[2]]


def test_preemption_takes_latest_arrival_and_recomputes():
    sched = make_scheduler(num_blocks=4, block_size=4, max_batched_tokens=100)
    a, b = make_seq(8), make_seq(7)  # a: 2 blocks, b: 2 blocks: the pool is full
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled; a now has 9 tokens, b has 8
    batch = step(sched)  # a needs a third block -> b (later arrival) is preempted
    assert batch.preempted == [b] and batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.num_preemptions == 1
    sched.block_manager.check_invariants([a])
    sched.finish(a)
    batch = step(sched)
    assert batch.seqs == [b] and batch.num_new_tokens == [8]  # prompt + its generated token, recomputed
    sched.finish(b)
    assert sched.block_manager.num_free_blocks == 4


def test_the_tail_sequence_preempts_itself():
    sched = make_scheduler(num_blocks=3, block_size=2, max_batched_tokens=100)
    a, b = make_seq(3), make_seq(2)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 2 blocks (4 tokens after sampling), b: 1 block
    batch = step(sched)  # a's decode needs no new block (token 4 fits), b's decode needs one: b preempts itself
    assert batch.seqs == [a] and batch.preempted == [b]
    assert sched.waiting == [b] and sched.running == [a]


def test_effort_policy_lets_short_budgets_overtake_long_ones_within_a_bound():
    from kiln.runtime.core.scheduler import EFFORT_TOKENS_PER_ARRIVAL

    sched = make_scheduler(policy="effort", max_seqs=1, max_batched_tokens=100)
    long = make_seq(3)
    long.max_tokens = 4 * EFFORT_TOKENS_PER_ARRIVAL  # due 4 arrivals after it came
    sched.add(long)
    shorts = []
    for _ in range(8):
        short = make_seq(3)
        short.max_tokens = 1
        shorts.append(short)
        sched.add(short)
    # the shorts that arrived before the long one's deadline go first, then it, then the rest
    assert [s.seq_id for s in sched.waiting] == [s.seq_id for s in shorts[:3]] + [long.seq_id] + \
        [s.seq_id for s in shorts[3:]]


def test_effort_policy_orders_reasoning_requests_by_their_thinking_budget():
    """The effort dial is a scheduler input: of two reasoning requests with the same max_tokens, the low-effort one
    overtakes the high-effort one that arrived before it."""
    from kiln.runtime.core.scheduler import EFFORT_ANSWER_TOKENS, EFFORT_TOKENS_PER_ARRIVAL, effort_budget
    from kiln.runtime.thinking import ThinkingConfig

    sched = make_scheduler(policy="effort", max_seqs=1, max_batched_tokens=100)
    seqs = []
    for budget in (8192, 1024, None):
        seq = make_seq(3)
        seq.max_tokens = 4096
        thinking = ThinkingConfig(start_ids=(5,), end_ids=(6,), force_ids=(6,), budget=budget)
        seq.params = SamplingParams(max_tokens=4096, thinking=thinking)
        seqs.append(seq)
    high, low, unbudgeted = seqs
    assert effort_budget(high) == 4096 and effort_budget(low) == 1024 + EFFORT_ANSWER_TOKENS
    assert effort_budget(unbudgeted) == 4096  # a thinking block without a budget: max_tokens bounds it
    for seq in seqs:
        sched.add(seq)
    assert sched.waiting == [low, high, unbudgeted]
    assert (high.arrival + 4096 // EFFORT_TOKENS_PER_ARRIVAL) > low.arrival  # within the bound: it may be overtaken


def test_effort_policy_keeps_a_lane_for_short_budgets():
    from kiln.runtime.core.scheduler import EFFORT_LONG_BUDGET

    sched = make_scheduler(policy="effort", max_seqs=4, max_batched_tokens=100, num_blocks=256)
    longs = [make_seq(3) for _ in range(4)]
    for seq in longs:
        seq.max_tokens = EFFORT_LONG_BUDGET + 1
        sched.add(seq)
    step(sched)
    assert sched.running == longs[:2] and sched.waiting == longs[2:]  # half the slots at most
    short = make_seq(3)
    short.max_tokens = 4
    sched.add(short)  # arrives behind them all, gets a free lane at once
    step(sched)
    assert short in sched.running and sched.waiting == longs[2:]
    fcfs = make_scheduler(policy="fcfs", max_seqs=4, max_batched_tokens=100, num_blocks=256)
    for seq in [make_seq(3) for _ in range(4)]:
        seq.max_tokens = EFFORT_LONG_BUDGET + 1
        fcfs.add(seq)
    step(fcfs)
    assert len(fcfs.running) == 4  # other policies: no lanes


def test_priority_policy_orders_waiting_queue():
    sched = make_scheduler(policy="priority", max_seqs=1, max_batched_tokens=100)
    low, high = make_seq(3), make_seq(3)
    low.priority, high.priority = 5, 0
    sched.add(low)
    sched.add(high)
    assert step(sched).seqs == [high]
