"""EngineCore: token ids in, token deltas out; one `step()` = schedule -> execute -> sample -> update."""
from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from pathlib import Path

import torch

from ..artifact import LoadedArtifact, load_artifact
from ..config import speculative_config
from ..errors import RequestError
from ..ipc.protocol import RequestLimits, SeqDelta
from ..outputs import FinishReason
from ..sampling_params import SamplingParams
from ..validation import check_request
from ..worker.executor import apply_swaps, create_executor, shutdown_on_error
from ..worker.interface import ExecutorError
from ..worker.lora import EngineLoRA
from . import overlap, pooling
from .batch import ScheduledBatch
from .constrained import ConstraintManager
from .kv_cache import BlockManager, SwapSpace
from .kv_offload import attach_offload
from .prefix_cache import make_prefix_cache
from .sampler import NONFINITE_TOKEN, Sampler, SamplerOutput
from .scheduler import Scheduler
from .sequence import PLACEHOLDER_TOKEN, Request, Sequence
from .speculative import Launched, make_speculator, speculator_pool_share
from .stats import core_stats
from .stops import TokenStops

logger = logging.getLogger(__name__)

_UNSET = object()


class EngineCore(EngineLoRA):
    """Serves one loaded artifact at the level of token ids: `add_request` queues a prompt, `step()` runs one forward
    pass and returns what it produced as `SeqDelta`s (new tokens, their logprobs, how a completion ended). Text, stop
    strings and decoded logprobs are the front-end's. Not thread-safe: one loop drives it (core/process.py).

    KV pool size: `num_kv_blocks`, else the manifest's `kv_cache.num_blocks`, else `kv_cache_bytes` (CPU default
    256 MiB), else on CUDA the memory plan (memory_plan.py). Scheduler limits default to the manifest's `scheduler`
    section. On CUDA a manifest `cuda_graphs` plan has decode graphs captured at load; `enforce_eager=True` skips
    that. `speculative` (default: the manifest's): "mtp" (the artifact's draft head), "ngram" or "draft" (the
    artifact `speculative_model`) drafts `num_speculative_tokens` a step (speculative/). `async_scheduling` (default: the manifest's, else on for CUDA, off for CPU) launches
    step N+1 before step N's tokens reach the host (overlap.py), so `step()` returns the deltas of the step before
    the one it launched. `kv_offload_bytes` (default: the manifest's `kv_cache.offload`): a CPU tier (kv_offload.py).
    `lora_roots`: the directories a client's `load_lora_adapter` may read from (None: run-time loading is off).

    The core ends a completion on a token (stops.py); the front-end on a stop string (`finish_sequences`).
    Failures stay with the request that causes them: `add_request` checks every value a sampler tensor will
    hold; a request with non-finite logits is failed alone (`stats()` counts them); a step that raises is run
    again on each half of its requests (`_isolate`), down to the request that fails on its own. A failed
    request ends with finish_reason "error" and a delta saying why; the others' tokens are unchanged.
    """

    def __init__(self, artifact: LoadedArtifact | str | Path, *, device: str | torch.device = "cpu",
                 num_kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 chunked_prefill: int | None = None, prefix_cache: str | None | object = _UNSET,
                 policy: str | None = None, preemption: str | None = None, swap_space_bytes: int | None = None,
                 kv_reserve: str | None = None, seed: int = 0, enforce_eager: bool = False,
                 speculative: str | None | object = _UNSET, num_speculative_tokens: int | None = None,
                 speculative_model: str | None = None, async_scheduling: bool | None = None,
                 executor: str | None = None, grammar_max_whitespace: int | None = 8,
                 grammar_compile_timeout: float = 10.0, kv_offload_bytes: int | None = None,
                 lora_roots: list[str] | None = None) -> None:
        self.artifact = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(artifact, device)
        self.model_config = cfg = self.artifact.model_config
        self.tokenizer = self.artifact.tokenizer
        kv, manifest = self.artifact.kv_cache_config, self.artifact.manifest
        sched = self.artifact.scheduler_config.with_overrides(
            max_seqs=max_num_seqs, max_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill,
            policy=policy, preemption=preemption, swap_space=swap_space_bytes, kv_reserve=kv_reserve)
        if sched.preemption not in ("recompute", "swap"):
            raise RequestError(f"unknown preemption mode {sched.preemption!r} (known: recompute, swap)")
        if prefix_cache is not _UNSET:
            sched = replace(sched, prefix_cache=None if prefix_cache in (None, "none") else prefix_cache)
        device = self.artifact.device
        sched, speculative, async_scheduling = pooling.overrides(manifest, sched, speculative, async_scheduling)
        method = (manifest.get("speculative") or {}).get("method") if speculative is _UNSET else speculative
        self.speculative = speculative_config(manifest, method, num_speculative_tokens, speculative_model)
        # what runs the model (executor.py): a ModelRunner here, or a parallel artifact's ranks; it sizes its KV pool
        self.runner = create_executor(self.artifact, sched, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                                      enforce_eager=enforce_eager, backend=executor,
                                      proposer=speculator_pool_share(self.speculative, self.artifact))
        with shutdown_on_error(self.runner):  # a refused option leaves no process (a mesh's ranks) running
            num_blocks = self.runner.num_blocks
            self.limits = RequestLimits(cfg.vocab_size, cfg.max_model_len, kv.block_size, num_blocks)
            self.block_manager = BlockManager(num_blocks, kv.block_size, make_prefix_cache(sched.prefix_cache))
            self.offload = attach_offload(self, kv.offload_bytes if kv_offload_bytes is None else kv_offload_bytes)
            self.scheduler = Scheduler(sched, self.block_manager, SwapSpace(self.runner.num_swap_blocks))
            self.attach_lora(lora_roots)  # `lora { }`: its adapters and slots; where clients may load more (lora.py)
            self.sampler = Sampler(seed, device)
            self.speculator = make_speculator(self.speculative, self.runner, self.sampler, self.artifact)
            eos = set(cfg.eos_token_ids)
            if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                eos = {self.tokenizer.eos_token_id}
            self.stops = TokenStops(frozenset(eos), cfg.max_model_len)
            self.requests: dict[str, Request] = {}
            self._pending: list[SeqDelta] = []  # ended outside a step (failed): sent with the next deltas
            self.num_nonfinite_logits = 0  # requests failed because their logits were not finite
            self._seq_ids, self._arrivals = itertools.count(), itertools.count()
            async_scheduling = sched.async_scheduling if async_scheduling is None else async_scheduling
            self.async_scheduling = device.type == "cuda" if async_scheduling is None else bool(async_scheduling)
            self._inflight: overlap.InFlight | None = None
            self.constraints = ConstraintManager(self, max_whitespace=grammar_max_whitespace,
                                                 compile_timeout=grammar_compile_timeout)
            self.pooler = pooling.make_pooler(self)  # an embedding artifact's (None: a generation artifact)

    # Requests ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, priority: int = 0, lora_name: str | None = None) -> None:
        """Queues a request (decoded with LoRA adapter `lora_name`, if given); `RequestError`: never servable."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        check_request(prompt_token_ids, params, self.limits)
        request = Request.new(request_id, prompt_token_ids, params, self.model_config.max_model_len, self._seq_ids,
                              self._arrivals, priority, self.artifact.device, self.lora_request_id(lora_name))
        self.requests[request_id] = request
        if not self.constraints.add(request_id, params, request.seqs):  # else queued once its grammar is compiled
            for seq in request.seqs:
                self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; nothing more is reported for it."""
        self.end_request(request_id, "abort")

    def finish_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Ends completions (request id, index) the front-end found finished (a stop string); unknown ones and
        finished ones are ignored."""
        for request_id, index in seqs:
            request = self.requests.get(request_id)
            if request is not None and 0 <= index < len(request.seqs):
                self._finish(request.seqs[index], "stop")
                if all(s.finish_reason is not None for s in request.seqs):
                    del self.requests[request_id]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        seq.finish_reason = seq.finish_reason or reason
        if seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # its step is in flight: a token not yet seen
            seq.token_ids.pop()

    def end_request(self, request_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """Ends a request now (its unfinished sequences with `reason`, their blocks freed); an error is
        reported with the next deltas. False if it was not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.finish_reason is None and error is not None:
                self._pending.append(SeqDelta(request_id, seq.index, [], finish_reason="error", error=error))
            self._finish(seq, reason)
        return True

    def _fail_nonfinite(self, request_id: str) -> None:
        if self.end_request(request_id, "error", "the model's logits for this request were not finite (NaN or "
                             "infinity), so no token could be sampled"):
            self.num_nonfinite_logits += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    # The step ---------------------------------------------------------------------------------------------
    def step(self) -> list[SeqDelta]:
        """Runs one forward pass; returns the deltas of every completion that progressed or ended (with async
        scheduling: in the previous forward pass, whose results this call reads back). Steps are synchronous
        while a constrained request runs (its next token's mask needs its last one)."""
        if self.pooler is not None:  # an embedding artifact: prefill-only requests, pooled (pooling.py)
            return self.pooler.step()
        self.constraints.admit()
        constrained = self.constraints.active
        if constrained and self._inflight is not None:  # read the step in flight back first
            prev, self._inflight = self._inflight, None
            deltas = overlap.finish(self, prev)
        elif (self.async_scheduling and not constrained) or self._inflight is not None:
            deltas = overlap.step(self)
        else:
            batch = self.scheduler.schedule()
            deltas = self._step_empty(batch) if batch.is_empty else self._step_sync(apply_swaps(self.runner, batch))
        self.constraints.after_step()
        return deltas

    def _step_sync(self, batch: ScheduledBatch) -> list[SeqDelta]:
        try:
            launched = self._launch(batch)  # execute -> sample
        except Exception as error:  # isolated to the requests it hits
            return self._isolate(batch, error)
        return self._commit(batch, launched)  # update

    def _launch(self, batch: ScheduledBatch) -> Launched:
        """execute -> sample. Changes nothing but the KV written at the batch's slots, which a second launch of
        the same sequences writes again."""
        if self.speculator is not None:
            return self.speculator.launch(batch)
        logits, layout = self.runner.execute(batch)
        return Launched(self.sampler.sample(logits, layout, batch.seqs))

    def _commit(self, batch: ScheduledBatch, launched: Launched) -> list[SeqDelta]:
        """update: the launched step's tokens become the sequences' (a request with a non-finite row is failed
        first and left out), token stops end what they end, the deltas are built; then the proposer drafts."""
        sampled, new_tokens, full_batch = launched.sampled, launched.new_tokens, batch
        if new_tokens is None:
            failed = NONFINITE_TOKEN in sampled.sampled and [t == NONFINITE_TOKEN for t in sampled.sampled]
        else:
            failed = any(NONFINITE_TOKEN in t for t in new_tokens) and [NONFINITE_TOKEN in t for t in new_tokens]
        if failed:
            for seq, bad in zip(batch.seqs, failed, strict=True):
                if bad:
                    self._fail_nonfinite(seq.request_id)
            live = batch.live()
            batch, sampled = batch.subset(live), sampled.subset(live)
            new_tokens = None if new_tokens is None else [new_tokens[i] for i in live]
        if new_tokens is None:
            return self.update(batch, sampled, self.scheduler.update(batch, sampled.sampled))
        grown = self.scheduler.update_verified(batch, new_tokens)
        deltas = self.update(batch, sampled, grown, [len(t) for t in new_tokens if t])  # grown's order
        self.speculator.propose(full_batch, launched)  # the whole batch: a draft head's rows are the forward's
        return deltas

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> list[SeqDelta]:
        """`batch` failed to launch. Its schedule stands (slots allocated, swaps done) and no state changed since,
        so each half of its requests is launched and committed on its own, a half that fails is split again, and
        a request that fails alone is failed with the error: one bad request costs about 2 log2(requests) extra
        launches and the others get the tokens the whole batch would have given them."""
        if isinstance(error, ExecutorError):  # the model's ranks are gone: no request's fault, nothing to retry
            raise error
        request_ids = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        if len(request_ids) == 1:
            logger.warning("request %s failed: %s: %s", request_ids[0], type(error).__name__, error)
            self.end_request(request_ids[0], "error", f"the engine failed on this request: "
                              f"{type(error).__name__}: {error}")
        if len(request_ids) <= 1:
            return self.take_pending()
        first = set(request_ids[:len(request_ids) // 2])
        deltas = []
        for half in (True, False):
            part = batch.subset([i for i, seq in enumerate(batch.seqs) if (seq.request_id in first) == half])
            deltas += self._step_sync(part)
        return deltas

    def _step_empty(self, batch: ScheduledBatch) -> list[SeqDelta]:
        """Nothing to run (everything running was swapped out this step, or nothing is left)."""
        self.runner.swap(batch)
        assert not (self.scheduler.waiting or self.scheduler.swapped) or self.scheduler.running or batch.swap_out, \
            "scheduler stalled: waiting requests but nothing can run (pool smaller than add_request checked?)"
        return self.take_pending()

    def take_pending(self) -> list[SeqDelta]:
        """The deltas of requests that ended outside a step (failed), not yet returned."""
        deltas, self._pending = self._pending, []
        return deltas

    # Update -----------------------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: SamplerOutput, grown: list[Sequence],
                 added: list[int] | None = None) -> list[SeqDelta]:
        """Token stops of the sequences that grew (`added[k]`: how many tokens grown[k] gained; None: one each),
        then the deltas: ended (failed) requests first, then every completion that progressed."""
        deltas = self.take_pending()
        logprobs = {}
        for seq, token, plp, lp in zip(batch.seqs, sampled.sampled, sampled.prompt_logprobs, sampled.logprobs,
                                       strict=True):
            if plp is not None:
                seq.num_prompt_logprobs += len(plp)
                if token is None:  # a prefill chunk that samples nothing: its prompt logprobs alone
                    deltas.append(SeqDelta(seq.request_id, seq.index, [], None, plp))
                    continue
            if plp is not None or lp is not None:
                logprobs[seq.seq_id] = ([lp] if isinstance(lp, tuple) else lp, plp)  # speculative: a list
        return deltas + self._deltas(grown, added, logprobs)

    def _deltas(self, grown: list[Sequence], added: list[int] | None = None,
                logprobs: dict[int, tuple] | None = None) -> list[SeqDelta]:
        """The token stops and then the deltas of the sequences that grew (`added`, `logprobs`: see `update`)."""
        requests = self.requests
        deltas = []
        for seq, m in zip(grown, itertools.repeat(1) if added is None else added):
            if seq.request_id not in requests:  # failed earlier in this step
                continue
            kept = self.stops.check_each(seq, m)
            lp, plp = logprobs.get(seq.seq_id, (None, None)) if logprobs else (None, None)
            deltas.append(SeqDelta(seq.request_id, seq.index, seq.token_ids[-kept:], lp and lp[:kept], plp,
                                   seq.finish_reason, seq.stop_reason))
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                request = requests[seq.request_id]
                if all(s.finish_reason is not None for s in request.seqs):
                    del requests[seq.request_id]
        return deltas

    def stats(self) -> dict[str, float]:
        """The core's counters (core/stats.py): sequences, KV usage, prefix cache, speculation, grammars."""
        return core_stats(self)
