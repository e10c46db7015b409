"""KV reservations at admission (scheduler `kv_reserve`): a sequence with a thinking budget is admitted only with
KV for all it may grow to (prompt + max_tokens), or waits, and is never preempted; the block manager's
bookkeeping of what it promised; the same tokens as with a pool that never runs short."""
from __future__ import annotations

import itertools
import random

import pytest
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.config import SchedulerConfig
from kiln.runtime.core.batch import cdiv
from kiln.runtime.core.kv_cache import BlockManager
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.core.sequence import Sequence, SequenceStatus
from kiln.runtime.thinking import ThinkingConfig

_ids = itertools.count()
BLOCK = 4
# a thinking block whose tags are single tokens; the budget forces the end tag (token 6) after 5 tokens
THINKING = ThinkingConfig(start_ids=(5,), end_ids=(6,), force_ids=(6,), budget=5)


def make_seq(prompt: int, max_tokens: int, reasoning: bool) -> Sequence:
    i = next(_ids)
    params = SamplingParams(max_tokens=max_tokens, thinking=THINKING if reasoning else None)
    return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(range(10, 10 + prompt)),
                    num_prompt_tokens=prompt, params=params, max_tokens=max_tokens, arrival=i)


def make_scheduler(num_blocks: int, **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_seqs": 8, "max_batched_tokens": 64, "chunked_prefill": 512, "policy": "fcfs",
                                "prefix_cache": None, "preemption": "recompute", "swap_space": 0,
                                "async_scheduling": None, **cfg})
    return Scheduler(config, BlockManager(num_blocks, BLOCK))


def step(sched: Scheduler, live: list[Sequence]) -> list[Sequence]:
    """One step with a fake sampler (token 7); finishes what reached max_tokens. Returns the preempted."""
    batch = sched.schedule()
    sampled = [7 if s.num_computed_tokens + n == s.num_tokens else None
               for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    for seq in sched.update(batch, sampled):
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq)
    sched.block_manager.check_invariants([s for s in live if not s.is_finished])
    return batch.preempted


def test_a_reasoning_sequence_waits_until_its_whole_budget_fits():
    sched = make_scheduler(num_blocks=6)
    hog = make_seq(prompt=8, max_tokens=4, reasoning=False)  # 2 blocks, growing to 3
    sched.add(hog)
    step(sched, [hog])
    thinker = make_seq(prompt=4, max_tokens=12, reasoning=True)  # its prompt fits, its budget (4 blocks) does not
    sched.add(thinker)
    live = [hog, thinker]
    while not hog.is_finished:
        step(sched, live)
        assert thinker.status is SequenceStatus.WAITING and not thinker.block_table
    step(sched, live)  # the hog's blocks are back: admitted with every block it may need promised to it
    assert thinker.status is SequenceStatus.RUNNING
    assert len(thinker.block_table) == 1 and thinker.num_reserved_blocks == cdiv(4 + 12, BLOCK)
    assert sched.block_manager.num_reserved == 3
    assert sched.block_manager.num_available_blocks == 6 - 1 - 3

    # without reservations it is admitted at once, on its prompt's blocks alone
    sched = make_scheduler(num_blocks=6, kv_reserve="none")
    hog, thinker = make_seq(8, 4, False), make_seq(4, 12, True)
    sched.add(hog)
    step(sched, [hog])
    sched.add(thinker)
    step(sched, [hog, thinker])
    assert thinker.status is SequenceStatus.RUNNING and thinker.num_reserved_blocks == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_no_reasoning_sequence_is_preempted_under_a_tiny_pool(preemption):
    """A random mix of reasoning and plain sequences through a pool far smaller than their sum: the plain ones
    are preempted, the reasoning ones never, and all finish. Without reservations the same workload preempts
    reasoning sequences mid-budget (what the mechanism is for)."""
    def run(kv_reserve: str) -> tuple[int, int]:
        rng = random.Random(0)
        sched = make_scheduler(num_blocks=24, kv_reserve=kv_reserve, preemption=preemption)
        if preemption == "swap":
            from kiln.runtime.core.kv_cache import SwapSpace
            sched.swap_space = SwapSpace(8)
        seqs = [make_seq(rng.randint(2, 12), rng.randint(8, 40), rng.random() < 0.5) for _ in range(24)]
        for s in seqs:
            sched.add(s)
        preempted_plain = preempted_reasoning = 0
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            for victim in step(sched, seqs):
                if victim.params.thinking is not None:
                    preempted_reasoning += 1
                else:
                    preempted_plain += 1
        assert all(s.is_finished and s.num_output_tokens == s.max_tokens for s in seqs)
        assert sched.block_manager.num_free_blocks == 24 and sched.block_manager.num_reserved == 0
        return preempted_plain, preempted_reasoning

    plain, reasoning = run("reasoning")
    assert reasoning == 0 and plain > 0
    assert run("none")[1] > 0


def test_kv_reserve_all_never_preempts():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=20, kv_reserve="all")
    seqs = [make_seq(rng.randint(2, 12), rng.randint(8, 40), False) for _ in range(16)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        assert not step(sched, seqs)
    assert sched.num_preemptions == 0 and all(s.num_output_tokens == s.max_tokens for s in seqs)


def test_draft_slots_past_the_reservation_are_dropped_not_preempted():
    sched = make_scheduler(num_blocks=4)
    thinker = make_seq(prompt=4, max_tokens=4, reasoning=True)  # reserves 2 blocks: 8 tokens
    sched.add(thinker)
    step(sched, [thinker])
    plain = make_seq(prompt=7, max_tokens=20, reasoning=False)  # takes the other 2 blocks
    sched.add(plain)
    for _ in range(2):
        step(sched, [thinker, plain])
    assert thinker.num_tokens == 7 and plain.num_tokens == 9 and plain.status is SequenceStatus.RUNNING
    thinker.draft_token_ids = [8, 9]  # verifying them would write slot 8: a third block, past its budget
    batch = sched.schedule()
    assert thinker in batch.seqs and batch.num_new_tokens[batch.seqs.index(thinker)] == 1
    assert thinker.draft_token_ids == [] and thinker.status is SequenceStatus.RUNNING


def test_block_manager_keeps_what_it_promised():
    bm = BlockManager(8, BLOCK)
    a = make_seq(prompt=6, max_tokens=10, reasoning=True)
    assert bm.allocate_slots(a, 6, reserve=4)  # 2 blocks now, 2 more promised
    assert (len(a.block_table), bm.num_reserved, bm.num_available_blocks) == (2, 2, 4)
    b = make_seq(prompt=20, max_tokens=1, reasoning=False)
    assert not bm.allocate_slots(b, 20)  # 5 blocks: 6 are free, but 2 of them are promised to a
    assert bm.allocate_slots(b, 16) and bm.num_available_blocks == 0
    a.num_computed_tokens = 6
    assert bm.allocate_slots(a, 6)  # its growth comes out of its reservation
    assert (len(a.block_table), bm.num_reserved, bm.num_available_blocks) == (3, 1, 0)
    bm.check_invariants([a, b])
    bm.truncate(a, 8)  # a rolled back past a block: the slot is promised to it again
    assert (len(a.block_table), bm.num_reserved) == (2, 2)
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.num_reserved == 0 and a.num_reserved_blocks == 0 and bm.num_available_blocks == 4
    bm.check_invariants([b])


def test_a_disaggregated_transfer_never_leases_promised_blocks():
    from kiln.runtime.core.lease import TransferLedger

    bm = BlockManager(8, BLOCK)
    a = make_seq(prompt=4, max_tokens=20, reasoning=True)
    assert bm.allocate_slots(a, 4, reserve=6)  # 1 block held, 5 promised: 2 available
    ledger = TransferLedger(bm)
    assert ledger.reserve("t1", 3) is None and bm.num_available_blocks == 2  # 7 free, but 5 promised to a
    assert ledger.reserve("t2", 2) is not None and bm.num_available_blocks == 0
    assert bm.num_free_blocks == bm.num_reserved == 5


TEXTS = ["The quick brown fox", "Once upon a time there was a small kiln that baked models", "héllo wörld",
         "Paged attention stores keys and values in fixed size blocks. The quick brown fox jumps"]


def _params(i: int) -> SamplingParams:
    thinking = ThinkingConfig(start_ids=(5,), end_ids=(6,), force_ids=(6,), budget=6) if i % 2 == 0 else None
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking=thinking)


def test_reasoning_requests_keep_their_tokens_and_are_not_preempted_in_a_tiny_pool(artifact_dir):
    with LLM(str(artifact_dir), prefix_cache=None) as big:
        prompts = [big.get_tokenizer().encode(t) for t in TEXTS * 2]
        params = [_params(i) for i in range(len(prompts))]
        reference = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
        assert big.engine.scheduler.num_preemptions == 0
    for kv_reserve in ("reasoning", "none"):
        # 40 blocks of 4 tokens: the eight requests need ~120 together, so the scheduler must preempt
        with LLM(str(artifact_dir), num_kv_blocks=40, prefix_cache=None, kv_reserve=kv_reserve) as llm:
            sched = llm.engine.scheduler
            victims: list[Sequence] = []
            preempt = sched._preempt
            sched._preempt = lambda seq, swap_out, victims=victims, preempt=preempt: (
                victims.append(seq), preempt(seq, swap_out))[1]
            outs = llm.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == reference
            assert victims and llm.engine.block_manager.num_reserved == 0
            llm.engine.block_manager.check_invariants([])
            reasoning_victims = [s for s in victims if s.params.thinking is not None]
            if kv_reserve == "reasoning":
                assert not reasoning_victims
            else:
                assert reasoning_victims  # what the reservation prevents
