"""Continuous-batching scheduler: token budget, chunked prefill, decodes first, preemption by recompute
or by swapping KV blocks to CPU memory, and KV reservations for sequences that must not be preempted."""
from __future__ import annotations

import bisect
from collections.abc import Callable

from ..config import SchedulerConfig
from .batch import ScheduledBatch, cdiv
from .kv_cache import BlockManager, SwapSpace
from .sequence import Sequence, SequenceStatus

# `effort`: earliest virtual deadline first, in lanes. A sequence is due EFFORT_TOKENS_PER_ARRIVAL budget tokens
# per arrival after it came, its budget being what it is expected to generate at most (`effort_budget`), so
# short requests overtake long-budget ones that arrived before them, but a sequence is only ever overtaken by
# those that arrived before its deadline: its wait is bounded by budget / EFFORT_TOKENS_PER_ARRIVAL later
# arrivals. And sequences with a budget over EFFORT_LONG_BUDGET hold at most half of max_seqs (at least one):
# the other half is a lane that short requests never wait for a long one to leave. The price: a workload of
# long requests alone runs at most half the batch.
EFFORT_TOKENS_PER_ARRIVAL = 16
EFFORT_LONG_BUDGET = 128
# the answer a reasoning request is expected to give after its thinking budget (it may give more, up to max_tokens)
EFFORT_ANSWER_TOKENS = 256


def thinking_budget(seq: Sequence) -> int | None:
    """The sequence's thinking budget (reasoning_effort, max_thinking_tokens), or None."""
    thinking = seq.params.thinking
    return None if thinking is None else thinking.budget


def effort_budget(seq: Sequence) -> int:
    """All a sequence may generate (max_tokens: thinking and answer alike), or for one with a thinking budget
    (reasoning_effort) that budget plus EFFORT_ANSWER_TOKENS when less: low effort overtakes high effort."""
    budget = thinking_budget(seq)
    return seq.max_tokens if budget is None else min(seq.max_tokens, budget + EFFORT_ANSWER_TOKENS)


def _effort_key(seq: Sequence) -> tuple:
    return (seq.arrival + effort_budget(seq) // EFFORT_TOKENS_PER_ARRIVAL, seq.arrival)


# Scheduling policies: the sort key of a sequence. Smallest key is served first; the largest running key is
# the first preemption victim.
POLICIES: dict[str, Callable[[Sequence], tuple]] = {
    "fcfs": lambda seq: (seq.arrival,),
    "priority": lambda seq: (seq.priority, seq.arrival),  # lower value = more urgent (vLLM's convention)
    "effort": _effort_key,
}


# KV reservation: which sequences are admitted only once the pool can hold all the KV they may grow to (prompt +
# max_tokens, the bound OpenAI's max_completion_tokens states: visible and reasoning tokens alike), and are then
# never preempted. "reasoning": those with a thinking budget (reasoning_effort, max_thinking_tokens), which would
# otherwise be admitted optimistically and preempted mid-thought when the pool runs short; "all": every sequence
# (no preemption at all, the least concurrency); "none": every one is admitted optimistically.
KV_RESERVE: dict[str, Callable[[Sequence], bool]] = {
    "none": lambda seq: False,
    "reasoning": lambda seq: thinking_budget(seq) is not None,
    "all": lambda seq: True,
}


class Scheduler:
    """Owns the waiting and running queues (both kept sorted by the policy key) and the block manager.

    `schedule()` picks the step's work and allocates its KV slots; `update()` advances the sequences after
    the forward pass; `finish()` releases a sequence. A preempted sequence loses its device blocks. With
    `preemption = "recompute"` (or when the swap space is full) it returns to the waiting queue with
    `num_computed_tokens = 0` and is recomputed (prompt + tokens so far) when readmitted. With
    `preemption = "swap"` its blocks' contents are copied to CPU blocks and it waits in `swapped`, ahead of
    new requests, until enough device blocks are free to copy them back and continue where it stopped.

    A sequence that `config.kv_reserve` selects is admitted with a reservation of every block it may grow to
    (BlockManager.allocate_slots' `reserve`), or waits, as any sequence does whose admission does not fit; the
    sequences behind it in policy order wait too, so it is not overtaken for good. Admitted, it never needs a
    block it was not promised (speculative draft slots past its budget are dropped instead), and it is never a
    preemption victim: only sequences without a reservation are, whose allocations never touch the blocks
    promised to reservations.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 swap_space: SwapSpace | None = None) -> None:
        if config.policy not in POLICIES:
            from ..errors import ArtifactError
            raise ArtifactError(f"unknown scheduler policy {config.policy!r} (known: {', '.join(POLICIES)})")
        if config.kv_reserve not in KV_RESERVE:
            from ..errors import ArtifactError
            raise ArtifactError(f"unknown kv_reserve {config.kv_reserve!r} (known: {', '.join(KV_RESERVE)})")
        assert config.max_batched_tokens > 0 and config.max_seqs > 0, f"bad scheduler config {config}"
        self.config = config
        self.block_manager = block_manager
        self._key = POLICIES[config.policy]
        self._reserves = KV_RESERVE[config.kv_reserve]
        self._chunk = config.chunked_prefill or config.max_batched_tokens
        self.swap_space = swap_space if config.preemption == "swap" else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        # multi-LoRA: at most this many distinct adapters among the running sequences (the device's adapter
        # slots, lora.LoRAManager); a waiting sequence of another adapter waits until one of them is done
        self.max_loras: int | None = None
        # Called with every sequence `finish` ends, before its blocks are freed (runtime/disagg: the prefill
        # role snapshots the K/V it sends, the decode role ends a lease).
        self.on_finish: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # Running sequences first, in policy order; victims come from the tail, which is not scheduled yet.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_output_tokens >= seq.max_tokens:
                i += 1  # async scheduling: its last token, still in flight, ends it by length; nothing to run
                continue
            n = self._num_new_tokens(seq, budget)
            while not self.block_manager.allocate_slots(seq, n):
                if seq.num_reserved_blocks and seq.draft_token_ids:  # draft slots past its reservation: none now
                    seq.draft_token_ids = []
                    n = self._num_new_tokens(seq, budget)
                    continue
                victim = self._pop_victim(i)
                self._preempt(victim, swap_out)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                # a decode verifying draft tokens runs several query tokens: the prefill path of the kernels
                (decodes if seq.is_decoding and n == 1 else prefills).append((seq, n))
                budget -= n
                i += 1

        # Swapped-out sequences come back before new requests, in policy order — but never in a step that
        # swapped something out: the blocks just freed may be the ones a swap-in would overwrite.
        while self.swapped and budget > 0 and len(self.running) < self.config.max_seqs and not preempted:
            seq = self.swapped[0]
            adapters = self._running_adapters()
            if adapters is not None and seq.lora_id is not None and seq.lora_id not in adapters \
                    and len(adapters) >= self.max_loras:
                break
            n = self._num_new_tokens(seq, budget)
            if not self.block_manager.allocate_slots(seq, n):
                break
            self.swapped.pop(0)
            swap_in.extend(zip(seq.cpu_blocks, seq.block_table, strict=False))
            self.swap_space.free(seq.cpu_blocks)
            seq.cpu_blocks = []
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            (decodes if seq.is_decoding else prefills).append((seq, n))
            budget -= n

        # Then admit waiting sequences, unless this step had to evict someone or someone waits swapped out.
        adapters = self._running_adapters()
        lanes = self._long_lanes()
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_seqs and not preempted \
                and not self.swapped:
            seq = self.waiting[w]
            # a sequence of an adapter not running waits while every adapter slot is taken by running ones, a
            # long-budget one (effort) while the long lane is full: the next waiting one may fit
            new_adapter = adapters is not None and seq.lora_id is not None and seq.lora_id not in adapters
            long = lanes is not None and effort_budget(seq) > EFFORT_LONG_BUDGET
            if (new_adapter and len(adapters) >= self.max_loras) or (long and lanes == 0):
                w += 1
                continue
            if new_adapter:
                adapters.add(seq.lora_id)
            if long:
                lanes -= 1
            remote = bool(seq.block_table)  # its prompt's K/V but the last token's came from a remote prefill
            if remote:
                hits, num_cached = [], seq.num_computed_tokens
            else:
                hits = [] if seq.needs_prompt_logprobs() else self.block_manager.get_computed_blocks(seq)
                num_cached = len(hits) * self.block_manager.block_size
            n = min(seq.num_tokens - num_cached, self._chunk, budget)
            reserve = cdiv(seq.num_prompt_tokens + seq.max_tokens, self.block_manager.block_size) \
                if self._reserves(seq) else 0
            if not self.block_manager.allocate_slots(seq, n, hits, reserve):
                # With nothing running no reservation is outstanding and the pool holds any one request
                # (check_request): only blocks held outside the queues (a disaggregated transfer's lease) can
                # keep it short. Waiting could not end then: the sequence goes in unreserved, as any other.
                if not reserve or self.running or not self.block_manager.allocate_slots(seq, n, hits):
                    break
            self.waiting.pop(w)
            seq.num_computed_tokens = num_cached
            if not remote:  # (a remote prefill's own prefix hit is counted by the decode role)
                seq.num_cached_tokens = max(seq.num_cached_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            prefills.append((seq, n))
            budget -= n

        work = decodes + prefills
        return ScheduledBatch(seqs=[s for s, _ in work], num_new_tokens=[n for _, n in work],
                              num_decodes=len(decodes), preempted=preempted, swap_out=swap_out, swap_in=swap_in)

    def _pop_victim(self, first: int) -> Sequence:
        """Takes the preemption victim out of `running`: the last sequence without a KV reservation among those
        not scheduled yet in this step (from index `first` on; the one at `first` is the one that needs blocks).
        Only when all of them have one (a reservation that fell short: a bug) the last of them."""
        running = self.running
        for j in range(len(running) - 1, first - 1, -1):
            if not running[j].num_reserved_blocks:
                return running.pop(j)
        return running.pop()  # the tail: `remove` would scan the whole queue for it

    def _long_lanes(self) -> int | None:
        """`effort`: how many more long-budget sequences may run now (None: every policy but effort)."""
        if self.config.policy != "effort":
            return None
        cap = max(1, self.config.max_seqs // 2)
        return max(0, cap - sum(1 for s in self.running if effort_budget(s) > EFFORT_LONG_BUDGET))

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Marks the batch's tokens computed and appends each sampled token; returns the sequences that grew."""
        grew = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= seq.num_tokens, f"seq {seq.seq_id} computed past its tokens"
            self.block_manager.register_full_blocks(seq)
            if token is not None:
                assert seq.num_computed_tokens == seq.num_tokens, f"seq {seq.seq_id} sampled mid-prefill"
                seq.token_ids.append(token)
                grew.append(seq)
        return grew

    def update_verified(self, batch: ScheduledBatch, new_tokens: list[list[int]]) -> list[Sequence]:
        """`update` for a speculative step: `new_tokens[i]` are the tokens seq i gains (a verifying seq: its
        accepted drafts, then the target model's next token). A verifying seq's KV is valid up to its last
        accepted draft; the rejected drafts' slots are rolled back (tail blocks freed)."""
        grew = []
        for seq, n, tokens in zip(batch.seqs, batch.num_new_tokens, new_tokens, strict=True):
            drafts = len(seq.draft_token_ids)
            seq.draft_token_ids = []
            if drafts:
                assert 1 <= len(tokens) <= drafts + 1, f"seq {seq.seq_id}: {len(tokens)} tokens for {drafts} drafts"
                seq.num_computed_tokens += len(tokens)  # the last token, then the accepted drafts
                self.block_manager.truncate(seq, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens += n
            if tokens:
                assert seq.num_computed_tokens == seq.num_tokens + len(tokens) - 1, f"seq {seq.seq_id} sampled mid-prefill"
                seq.token_ids.extend(tokens)
                grew.append(seq)
            assert seq.num_computed_tokens <= seq.num_tokens, f"seq {seq.seq_id} computed past its tokens"
            self.block_manager.register_full_blocks(seq)
        return grew

    def finish(self, seq: Sequence) -> None:
        """Removes `seq` from whichever queue holds it and frees its blocks (finished or aborted)."""
        if self.on_finish is not None:
            self.on_finish(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_space.free(seq.cpu_blocks)
            seq.cpu_blocks = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _running_adapters(self) -> set[int] | None:
        """The adapters of the running sequences (None: no cap on them)."""
        if self.max_loras is None:
            return None
        return {s.lora_id for s in self.running if s.lora_id is not None}

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        assert remaining > 0, f"running seq {seq.seq_id} has nothing to compute"
        if remaining == 1 and seq.draft_token_ids:  # verify the drafts with the last token, or drop them
            if 1 + len(seq.draft_token_ids) <= budget:
                return 1 + len(seq.draft_token_ids)
            seq.draft_token_ids = []
        return min(remaining, budget) if remaining == 1 else min(remaining, self._chunk, budget)

    def _preempt(self, seq: Sequence, swap_out: list[tuple[int, int]]) -> None:
        """`seq` was just popped from `running`."""
        self.num_preemptions += 1
        seq.draft_token_ids = []  # its slots were allocated in this step, now given up
        # Every block of a running sequence holds computed K/V (allocation is all-or-nothing per step).
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, self.block_manager.block_size), \
            f"seq {seq.seq_id}: {len(seq.block_table)} blocks for {seq.num_computed_tokens} computed tokens"
        if self.swap_space is not None and seq.num_computed_tokens and \
                len(seq.block_table) <= self.swap_space.num_free_blocks:
            seq.cpu_blocks = self.swap_space.allocate(len(seq.block_table))
            swap_out.extend(zip(seq.block_table, seq.cpu_blocks, strict=True))
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self._key)
            self.num_swapped_out += 1
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.add(seq)
