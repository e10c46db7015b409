"""LLMEngine: requests in, RequestOutputs out; one `step()` = schedule -> execute -> sample -> update."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .artifact import LoadedArtifact, load_artifact
from .config import speculative_config
from .errors import RequestError
from .executor import ExecutorError, create_executor
from .kv_cache import BlockManager, SwapSpace, cdiv
from .model_runner import DraftInput, LogitsLayout
from .outputs import CompletionOutput, FinishReason, Logprob, PositionLogprobs, RequestOutput
from .prefix_cache import make_prefix_cache
from .sampler import NONFINITE_TOKEN, Sampler, SamplerOutput, TokenLogprobs
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from .tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

_UNSET = object()


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # read for every progressing request every step: a loop beats all(genexpr)
            if s.finish_reason is None:
                return False
        return True


@dataclass(slots=True)
class _InFlight:
    """A step launched but not read back (async scheduling): row `rows[k]` of its sampled `tokens` (on the
    device; `host` is their copy, complete once `ready` fires) belongs to `seqs[k]`, whose token_ids hold a
    placeholder for it at `positions[k]`."""

    seqs: list[Sequence]
    positions: list[int]
    rows: list[int]
    row_of: dict[int, int]  # seq_id -> row, for the next step's device-side input ids
    tokens: torch.Tensor
    host: torch.Tensor
    ready: object | None  # torch.cuda.Event on CUDA


@dataclass(slots=True)
class _Launched:
    """A batch's forward pass and sampling, done before any of the engine's state changes (so that a failure
    up to here can be retried on parts of the batch). Speculative steps add the tokens each sequence gains
    (verified drafts) and what the draft head reads afterwards."""

    sampled: SamplerOutput
    new_tokens: list[list[int]] | None = None
    draft_input: DraftInput | None = None
    starts: list[int] | None = None


class LLMEngine:
    """Serves one loaded artifact. Not thread-safe: a server drives it from one loop.

    KV pool size: `num_kv_blocks` if given, else the manifest's `kv_cache.num_blocks`, else `kv_cache_bytes`
    (CPU default 256 MiB), else on CUDA the memory plan (model_runner.plan_memory): memory_fraction of the
    device less the weights, the activation peak of a dummy max_num_batched_tokens prefill and the decode
    graphs' estimated reserve; `runner.memory_plan` keeps it. Scheduler limits default to the manifest's `scheduler` section.
    On a CUDA device, a manifest `cuda_graphs` plan has decode graphs captured at load (after the KV cache is
    allocated); `enforce_eager=True` skips that. CPU always runs eagerly.

    `speculative="mtp"` (default: the manifest's `speculative` section) decodes with the artifact's MTP draft
    head: after each step the head proposes one token per sequence (its argmax), and the next step verifies it
    with the target model: the target's token after the last one is sampled as usual, the draft is accepted when
    it equals it, and then the target's token after the draft is sampled too. For a greedy request that is plain
    greedy decoding; for a sampled one it is rejection sampling against a one-point draft distribution (accept d
    with probability p(d), else sample p without d), so tokens follow the target distribution exactly. Requests
    with penalties or logprobs decode one token a step as usual.

    `executor` ("mp", "local"; a parallel artifact only): its ranks as worker processes (default), or all in this
    process (the single-process mesh); runtime/executor.py.

    `async_scheduling` (default: the manifest's `scheduler.async_scheduling`, else on for CUDA, off for CPU,
    where torch runs synchronously and nothing could overlap) overlaps the host's work with the device's:
    `step()` schedules and launches step N+1 before step N's sampled tokens reach the host, assuming every
    sequence step N sampled for goes on (a placeholder token stands for it; step N+1 takes its input id from
    step N's token tensor on the device), then reads step N's tokens back and processes them (detokenize,
    stops, outputs) while step N+1 runs. So `step()` returns the outputs of the step before the one it
    launched. A sequence found finished late computed one token too many: it is dropped and its KV freed, so
    outputs equal the synchronous engine's for greedy and seeded requests (unseeded ones draw from the shared
    generator in another order). A step runs synchronously (after reading back any step in flight) when a
    sequence in it has penalties (they count the previous token on the host), logprobs or prompt logprobs
    (read back every step), or when speculative decoding is on.

    Failures stay with the request that causes them. `add_request` checks every value a sampler tensor will
    hold. A request whose logits come out non-finite (NaN or infinity) is failed alone (`stats()` counts them).
    A step whose forward pass or sampling raises is run again on each half of its requests (`_isolate`: the
    step's schedule stands and nothing else has changed yet), down to the single request that fails on its
    own; a request whose stop checks or detokenizing raise is failed alone. A failed request ends with
    finish_reason "error" and `RequestOutput.error` saying why; the other requests' tokens are unchanged.
    """

    def __init__(self, artifact: LoadedArtifact | str | Path, *, device: str | torch.device = "cpu",
                 num_kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 chunked_prefill: int | None = None, prefix_cache: str | None | object = _UNSET,
                 policy: str | None = None, preemption: str | None = None, swap_space_bytes: int | None = None,
                 seed: int = 0, enforce_eager: bool = False, speculative: str | None | object = _UNSET,
                 num_speculative_tokens: int | None = None, async_scheduling: bool | None = None,
                 output_kind: str = "cumulative", executor: str | None = None) -> None:
        if output_kind not in ("cumulative", "final"):
            raise RequestError(f"unknown output_kind {output_kind!r} (known: cumulative, final)")
        # "final": `step()` returns a request's output only once it finishes (offline `LLM.generate` reads
        # nothing else), sparing every step the per-request output with its O(output length) copies.
        self.output_kind = output_kind
        if not isinstance(artifact, LoadedArtifact):
            artifact = load_artifact(artifact, device)
        self.artifact = artifact
        self.model_config = artifact.model_config
        self.tokenizer = artifact.tokenizer
        kv = artifact.kv_cache_config
        sched = artifact.scheduler_config.with_overrides(
            max_seqs=max_num_seqs, max_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunked_prefill, policy=policy, preemption=preemption, swap_space=swap_space_bytes)
        if sched.preemption not in ("recompute", "swap"):
            raise RequestError(f"unknown preemption mode {sched.preemption!r} (known: recompute, swap)")
        if prefix_cache is not _UNSET:
            sched = replace(sched, prefix_cache=None if prefix_cache in (None, "none") else prefix_cache)
        # the model's executor (runtime/executor.py): a ModelRunner here, or a parallel artifact's ranks; it sizes
        # and allocates the KV pool (`runner.memory_plan`)
        self.runner = create_executor(artifact, sched, num_kv_blocks=num_kv_blocks, kv_cache_bytes=kv_cache_bytes,
                                      enforce_eager=enforce_eager, backend=executor)
        self.block_manager = BlockManager(self.runner.num_blocks, kv.block_size, make_prefix_cache(sched.prefix_cache))
        self.scheduler = Scheduler(sched, self.block_manager, SwapSpace(self.runner.num_swap_blocks))
        self.sampler = Sampler(seed, artifact.device)
        spec = artifact.manifest.get("speculative") or {}
        self.speculative = speculative_config(
            artifact.manifest, spec.get("method") if speculative is _UNSET else speculative,
            num_speculative_tokens if num_speculative_tokens is not None else spec.get("num_tokens"))
        self.num_draft_tokens = 0  # drafts verified so far, and of them accepted
        self.num_accepted_tokens = 0
        eos = set(self.model_config.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = {self.tokenizer.eos_token_id}
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []  # ended outside a step's outputs (aborted, failed): sent next
        self.num_nonfinite_logits = 0  # requests failed because their logits were not finite
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        if async_scheduling is None:
            async_scheduling = sched.async_scheduling
        self.async_scheduling = artifact.device.type == "cuda" if async_scheduling is None else bool(async_scheduling)
        self._inflight: _InFlight | None = None

    # Requests ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, prompt: str | None = None, priority: int = 0) -> None:
        """Queues a request; raises `RequestError` (nothing queued) when it can never be served."""
        params = params or SamplingParams()
        self._validate(request_id, prompt_token_ids, params)
        ids = [int(t) for t in prompt_token_ids]
        max_tokens = params.max_tokens or self.model_config.max_model_len - len(ids)
        seqs = []
        for i in range(params.n):
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=list(ids),
                           num_prompt_tokens=len(ids), params=params, max_tokens=max_tokens,
                           arrival=next(self._arrivals), priority=priority,
                           want_prompt_logprobs=params.prompt_logprobs is not None and i == 0)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.artifact.device).manual_seed(params.seed + i)
            if seq.want_prompt_logprobs:
                seq.prompt_logprobs = [None]
            if params.logprobs is not None:
                seq.output_logprobs = []
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, prompt, ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stops a request now; its final output (finish_reason "abort") comes from the next `step()`."""
        self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """Ends a request now (its unfinished sequences with `reason`, their blocks freed); its final output
        comes with the next outputs. False if it was not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = reason
                if seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # its step is in flight: a token not yet seen
                    seq.token_ids.pop()
        out = self._make_output(request)
        out.error = error
        self._aborted.append(out)
        return True

    def _fail_nonfinite(self, request_id: str) -> None:
        if self._end_request(request_id, "error", "the model's logits for this request were not finite (NaN or "
                             "infinity), so no token could be sampled"):
            self.num_nonfinite_logits += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted)

    # The step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one forward pass; returns the cumulative output of every request that progressed (with async
        scheduling: that progressed in the previous forward pass, whose results this call reads back)."""
        if self.async_scheduling or self._inflight is not None:
            return self._step_overlapped()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return self._step_empty(batch)
        return self._step_sync(self._swapped(batch))

    def _swapped(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Copies the batch's swapped KV blocks now and returns it without swaps: a launch that fails and
        runs again (`_isolate`) must not copy them twice (a block swapped out may be rewritten by this very
        step). A failing copy is no request's own: it propagates."""
        if not (batch.swap_out or batch.swap_in):
            return batch
        self.runner.swap(batch)
        return replace(batch, swap_out=[], swap_in=[])

    def _step_sync(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launches `batch`, reads its tokens back and processes them (nothing in flight)."""
        try:
            launched = self._launch(batch)
        except Exception as error:  # isolated to the requests it hits
            return self._isolate(batch, error)
        return self._commit(batch, launched)

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """execute -> sample (speculative: -> verify). Changes nothing but the KV written at the batch's slots,
        which a second launch of the same sequences writes again."""
        if self.speculative is not None:
            return self._launch_speculative(batch)
        logits, layout = self.runner.execute(batch)
        return _Launched(self.sampler.sample(logits, layout, batch.seqs))

    def _commit(self, batch: ScheduledBatch, launched: _Launched) -> list[RequestOutput]:
        """update -> process (speculative: -> propose): the launched step's tokens become the sequences'. A
        request with a non-finite row is failed first and left out."""
        sampled, new_tokens = launched.sampled, launched.new_tokens
        full_batch = batch
        if new_tokens is None:
            if NONFINITE_TOKEN in sampled.sampled:
                for seq, token in zip(batch.seqs, sampled.sampled, strict=True):
                    if token == NONFINITE_TOKEN:
                        self._fail_nonfinite(seq.request_id)
                batch, sampled, _ = self._live(batch, sampled)
            return self._process(batch, sampled, self.scheduler.update(batch, sampled.sampled))
        if any(NONFINITE_TOKEN in tokens for tokens in new_tokens):
            for seq, tokens in zip(batch.seqs, new_tokens, strict=True):
                if NONFINITE_TOKEN in tokens:
                    self._fail_nonfinite(seq.request_id)
            batch, sampled, live = self._live(batch, sampled)
            new_tokens = [new_tokens[i] for i in live]
        grown = self.scheduler.update_verified(batch, new_tokens)
        outputs = self._process(batch, sampled, grown, [len(t) for t in new_tokens if t])  # grown's order
        if launched.draft_input is not None:  # the whole batch: the draft head's rows are the forward's
            self._propose(full_batch, launched.draft_input, launched.starts, launched.new_tokens)
        return outputs

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """`batch` failed to launch. Its schedule stands (slots allocated, swaps done) and no state changed since,
        so each half of its requests is launched and committed on its own, a half that fails is split again,
        and a request that fails alone is failed with the error: one bad request costs about 2 log2(requests)
        extra launches and the others get the tokens the whole batch would have given them. A failure that is
        not any one request's fails them all (2 x requests launches, once)."""
        if isinstance(error, ExecutorError):  # the model's ranks are gone: no request's fault, nothing to retry
            raise error
        request_ids = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        if not request_ids:  # everything in it finished meanwhile
            return self._drain_aborted()
        if len(request_ids) == 1:
            logger.warning("request %s failed: %s: %s", request_ids[0], type(error).__name__, error)
            self._end_request(request_ids[0], "error", f"the engine failed on this request: "
                              f"{type(error).__name__}: {error}")
            return self._drain_aborted()
        first = set(request_ids[:len(request_ids) // 2])
        outputs = []
        for half in (True, False):
            part = _sub_batch(batch, [i for i, seq in enumerate(batch.seqs) if (seq.request_id in first) == half])
            try:
                launched = self._launch(part)
            except Exception as e:
                outputs += self._isolate(part, e)
            else:
                outputs += self._commit(part, launched)
        return _latest(outputs)

    @staticmethod
    def _live(batch: ScheduledBatch, sampled: SamplerOutput | None = None
              ) -> tuple[ScheduledBatch, SamplerOutput | None, list[int]]:
        """The batch's sequences that did not finish meanwhile (found finished late, aborted or failed), with
        their rows of `sampled`, and their indices in `batch`."""
        finished = SequenceStatus.FINISHED
        live = [i for i, seq in enumerate(batch.seqs) if seq.status is not finished]
        if len(live) == len(batch.seqs):
            return batch, sampled, live
        if sampled is not None:
            sampled = SamplerOutput(*([getattr(sampled, f)[i] for i in live]
                                      for f in ("sampled", "logprobs", "prompt_logprobs")))
        return _sub_batch(batch, live), sampled, live

    def _step_empty(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Nothing to run (everything running was swapped out this step, or nothing is left)."""
        self.runner.swap(batch)
        assert not (self.scheduler.waiting or self.scheduler.swapped) or self.scheduler.running \
            or batch.swap_out, \
            "scheduler stalled: waiting requests but nothing can run (pool smaller than add_request checked?)"
        return self._drain_aborted()

    # Async scheduling ---------------------------------------------------------------------------------------
    @staticmethod
    def _overlaps(seq: Sequence) -> bool:
        """Whether `seq` may sample on the device without its token read back before the next step."""
        p = seq.params
        return not p.has_penalties and p.logprobs is None and not seq.needs_prompt_logprobs()

    def _step_overlapped(self) -> list[RequestOutput]:
        """schedule N+1 (step N's sequences assumed one token longer) -> launch N+1 (input ids of step N's
        sequences gathered on the device) -> sample N+1 on the device, its tokens copied to the host without a
        sync -> read back and process step N -> advance N+1's sequences by a placeholder each. A step that
        cannot overlap (`_overlaps`, speculative decoding, async scheduling switched off) samples and is
        processed at once, after step N."""
        prev, self._inflight = self._inflight, None
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if prev is not None:  # what is not scheduled may be finishing in the step in flight
                self.runner.swap(batch)
                return self._finish_inflight(prev)
            return self._step_empty(batch)
        overlap = self.async_scheduling and self.speculative is None and all(map(self._overlaps, batch.seqs))
        batch = self._swapped(batch)
        if prev is None and not overlap:
            return self._step_sync(batch)
        patch = self._input_patch(batch, prev)
        try:
            logits, layout = self.runner.execute(batch) if patch is None else self.runner.execute(batch, patch)
            if overlap:
                tokens, marked = self.sampler.sample_on_device(logits, layout, batch.seqs)
                host, ready = _copy_to_host(marked)
        except Exception:  # not launched: read step N back, then run this one synchronously
            outputs = self._finish_inflight(prev) if prev is not None else self._drain_aborted()
            return _latest(outputs + self._step_sync(self._live(batch)[0]))
        outputs = self._finish_inflight(prev) if prev is not None else self._drain_aborted()
        # Sequences finished late (or aborted, or failed) are left out: their extra token is dropped.
        live_batch, _, live = self._live(batch)
        if overlap:
            rows = [layout.sample_rows[i] for i in live]
            grown = self.scheduler.update(live_batch, [None if r is None else PLACEHOLDER_TOKEN for r in rows])
            rows = [r for r in rows if r is not None]  # update returns the sampled seqs in batch order
            self._inflight = _InFlight(seqs=grown, positions=[len(s.token_ids) - 1 for s in grown], rows=rows,
                                       row_of=dict(zip([s.seq_id for s in grown], rows, strict=True)),
                                       tokens=tokens, host=host, ready=ready)
            return outputs
        try:
            sampled = self.sampler.sample(logits, layout, batch.seqs)
        except Exception as error:
            return _latest(outputs + self._isolate(live_batch, error))
        _, sampled, _ = self._live(batch, sampled)
        return _latest(outputs + self._commit(live_batch, _Launched(sampled)))

    @staticmethod
    def _input_patch(batch: ScheduledBatch, prev: _InFlight | None) -> tuple[list[int], list[int], torch.Tensor] | None:
        """(input rows, rows of step N's tokens, those tokens): the input ids of the batch's sequences whose
        last token is still on the device. Only decodes can have one (a preempted sequence is readmitted
        only after its step was read back)."""
        if prev is None:
            return None
        dst, src = [], []
        for i, seq in enumerate(batch.seqs):
            if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                assert i < batch.num_decodes, f"seq {seq.seq_id}: a prefill chunk reads a token still in flight"
                dst.append(i)
                src.append(prev.row_of[seq.seq_id])
        return (dst, src, prev.tokens) if dst else None

    def _finish_inflight(self, prev: _InFlight) -> list[RequestOutput]:
        """Reads step N's tokens back (waiting for that step only), puts them in place of the placeholders
        and processes them as the synchronous step would have."""
        if prev.ready is not None:
            prev.ready.synchronize()
        values = prev.host.tolist()
        grown = []
        finished = SequenceStatus.FINISHED
        for seq, pos, row in zip(prev.seqs, prev.positions, prev.rows, strict=True):
            if seq.status is finished:  # aborted meanwhile (abort_request dropped the placeholder)
                continue
            token_ids = seq.token_ids
            assert pos == len(token_ids) - 1 and token_ids[pos] == PLACEHOLDER_TOKEN, \
                f"seq {seq.seq_id}: no placeholder at {pos}"
            token = values[row]
            if token == NONFINITE_TOKEN:
                self._fail_nonfinite(seq.request_id)
                continue
            token_ids[pos] = token
            grown.append(seq)
        return self._outputs(grown)

    # Speculative decoding ---------------------------------------------------------------------------------
    @staticmethod
    def _drafts_for(seq: Sequence) -> bool:
        """Requests without penalties (they would have to count the drafts) or logprobs (one row a step)."""
        p = seq.params
        return not p.has_penalties and p.logprobs is None and p.prompt_logprobs is None

    def _launch_speculative(self, batch: ScheduledBatch) -> _Launched:
        """The step's launch with the draft head: schedule (drafting seqs run their last token + drafts) -> target
        forward keeping hidden states -> sample / verify (the longest draft prefix equal to the target's tokens,
        plus the target's next token); `_commit` then updates (rejected drafts' KV rolled back) and runs the
        draft head over the same positions with the tokens shifted by one -> next drafts."""
        seqs = batch.seqs
        draft_input = None
        if any(self._drafts_for(seq) for seq in seqs):
            logits, layout, draft_input = self.runner.execute_with_hidden(batch)
        else:
            logits, layout = self.runner.execute(batch)
        sampled = self.sampler.sample(logits, layout, seqs)
        starts = [seq.num_computed_tokens for seq in seqs]
        return _Launched(sampled, self._verify(batch, logits, layout, sampled.sampled), draft_input, starts)

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor, layout: LogitsLayout,
                sampled: list[int | None]) -> list[list[int]]:
        """Per seq, the tokens it gains: a verifying seq's accepted drafts (each equal to the target's token
        sampled at its position), then the target's token after the last accepted one."""
        out = [[] if t is None else [t] for t in sampled]
        verifying = [i for i, seq in enumerate(batch.seqs) if seq.draft_token_ids]
        if not verifying:
            return out
        row_seqs = [batch.seqs[i] for i in verifying for _ in batch.seqs[i].draft_token_ids]
        rows = [layout.sample_rows[i] + 1 + j for i in verifying for j in range(len(batch.seqs[i].draft_token_ids))]
        targets = self.sampler.sample_tokens(logits[rows], row_seqs)
        k = 0
        for i in verifying:
            drafts = batch.seqs[i].draft_token_ids
            after = targets[k:k + len(drafts)]  # the target's token after each draft
            k += len(drafts)
            accepted = out[i]
            for d, t in zip(drafts, after):
                if accepted[-1] != d:
                    break
                accepted.append(t)
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += len(accepted) - 1
        return out

    def _propose(self, batch: ScheduledBatch, draft_input: DraftInput, starts: list[int],
                 new_tokens: list[list[int]]) -> None:
        """Runs the draft head over the step's tokens (keeping its KV complete for every computed position) and
        stores a draft for each seq that drafts (`_drafts_for`) and goes on decoding."""
        input_ids: list[int] = []
        rows: list[int] = []
        wanting: list[Sequence] = []
        k = self.speculative.num_tokens
        for seq, n, start, tokens in zip(batch.seqs, batch.num_new_tokens, starts, new_tokens, strict=True):
            ids = seq.token_ids[start + 1:start + 1 + n]  # token t+1 at position t
            base = len(input_ids)
            input_ids.extend(ids + [0] * (n - len(ids)))  # rows past a rejected draft: unread
            if (tokens and seq.finish_reason is None and self._drafts_for(seq)
                    and seq.num_tokens + k <= self.model_config.max_model_len
                    and seq.num_output_tokens + 1 < seq.max_tokens):
                rows.append(base + seq.num_computed_tokens - 1 - start)  # the last position with valid KV
                wanting.append(seq)
        drafts = self.runner.propose(self.speculative.model_method, draft_input, input_ids, rows)
        for seq, d in zip(wanting, drafts, strict=True):
            seq.draft_token_ids = [d]

    def _process(self, batch: ScheduledBatch, sampled: SamplerOutput, grown: list[Sequence],
                 added: list[int] | None = None) -> list[RequestOutput]:
        for seq, plp, lp in zip(batch.seqs, sampled.prompt_logprobs, sampled.logprobs, strict=True):
            try:
                if plp is not None:
                    seq.prompt_logprobs.extend(self._logprob_dict(x) for x in plp)
                if lp is not None:
                    seq.output_logprobs.append(self._logprob_dict(lp))
                    seq.cumulative_logprob += lp[1][0]
            except Exception as e:  # a detokenizer failing on this request fails it alone
                self._fail_processing(seq, e)
        return self._outputs(grown, added)

    def _outputs(self, grown: list[Sequence], added: list[int] | None = None) -> list[RequestOutput]:
        """Stop checks of the sequences that grew (`added[k]`: how many tokens grown[k] gained; None: one
        each), then the outputs: ended (aborted, failed) requests first, then every request that progressed."""
        touched: dict[str, Request] = {}
        requests = self.requests
        failed = False
        for seq, m in zip(grown, itertools.repeat(1) if added is None else added):
            request = requests.get(seq.request_id)
            if request is None:  # failed earlier in this step
                continue
            try:
                if m > 1:
                    self._check_stop_each(seq, m)
                else:
                    self._check_stop(seq)
            except Exception as e:  # its stop strings or detokenizer: this request's alone
                self._fail_processing(seq, e)
                failed = True
                continue
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched[seq.request_id] = request
        if failed:
            touched = {request_id: r for request_id, r in touched.items() if request_id in requests}
        outputs = self._drain_aborted()
        final_only = self.output_kind == "final"
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
            elif final_only:
                continue
            outputs.append(self._make_output(request))
        return outputs

    def _fail_processing(self, seq: Sequence, error: Exception) -> None:
        logger.warning("request %s failed: %s: %s", seq.request_id, type(error).__name__, error)
        self._end_request(seq.request_id, "error", f"the engine failed to process this request's output: "
                          f"{type(error).__name__}: {error}")

    def _check_stop(self, seq: Sequence) -> None:
        """Token stops end the sequence before the token is detokenized (its text is never shown)."""
        token, params = seq.token_ids[-1], seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
            return
        if token in params.stop_token_set:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        if seq.detokenizer is not None:
            before = len(seq.output_text)
            seq.detokenizer.add_tokens([token])
            seq.output_text = seq.detokenizer.text
            if params.stop_strings and self._truncate_at_stop(seq, before):
                return
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= self.model_config.max_model_len:
            seq.finish_reason = "length"

    def _check_stop_each(self, seq: Sequence, m: int) -> None:
        """`_check_stop` for each of the last `m` tokens in turn; tokens after a stop are dropped."""
        tail = seq.token_ids[-m:]
        del seq.token_ids[-m:]
        for token in tail:
            seq.token_ids.append(token)
            self._check_stop(seq)
            if seq.finish_reason is not None:
                return

    @staticmethod
    def _truncate_at_stop(seq: Sequence, before: int) -> bool:
        text = seq.output_text
        found: tuple[int, str] | None = None
        for stop in seq.params.stop_strings:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return False
        seq.output_text = text[:found[0]]
        seq.finish_reason, seq.stop_reason = "stop", found[1]
        return True

    def _logprob_dict(self, entry: TokenLogprobs) -> PositionLogprobs:
        ids, lps, ranks = entry
        out: PositionLogprobs = {}
        for tid, lp, rank in zip(ids, lps, ranks):
            if tid not in out:
                text = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer else None
                out[tid] = Logprob(logprob=lp, rank=rank, decoded_token=text)
        return out

    def _make_output(self, request: Request) -> RequestOutput:
        """A snapshot: token ids and logprobs are copied (the sequence keeps growing), the text is immutable.
        Built for every progressing request every step, so written for speed (positional, no properties)."""
        completions = []
        finished = True
        for s in request.seqs:
            lps = s.output_logprobs
            completions.append(CompletionOutput(
                s.index, s.output_text, s.token_ids[s.num_prompt_tokens:],
                s.cumulative_logprob if lps is not None else None, lps[:] if lps is not None else None,
                s.finish_reason, s.stop_reason))
            finished = finished and s.finish_reason is not None
        plp = request.seqs[0].prompt_logprobs
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             plp[:] if plp else None, completions, finished)

    def _drain_aborted(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        return outputs

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything the request's sequences will put in a tensor, checked before any of it is queued."""
        cfg = self.model_config
        params.check()  # again: the object may have changed since it was built
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be ints in [0, {cfg.vocab_size})")
        n = len(prompt_token_ids)
        if n >= cfg.max_model_len:
            raise RequestError(f"the prompt has {n} tokens but max_model_len is {cfg.max_model_len} "
                               "(prompt plus generated tokens)")
        total = n + (params.max_tokens or cfg.max_model_len - n)
        if total > cfg.max_model_len:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                               f"max_model_len {cfg.max_model_len}")
        blocks = cdiv(total, self.block_manager.block_size)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(f"the request needs up to {blocks} KV blocks but the cache holds "
                               f"{self.block_manager.num_blocks}; lower max_tokens or enlarge the KV cache")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cfg.vocab_size:
                raise RequestError(f"{name}={value} exceeds the vocabulary size {cfg.vocab_size}")
        if params.stop_token_ids and max(params.stop_token_ids) >= cfg.vocab_size:
            raise RequestError(f"stop_token_ids must be in [0, {cfg.vocab_size}), got {max(params.stop_token_ids)}")

    def stats(self) -> dict[str, float]:
        """Counts are of sequences; prefix-cache queries and hits are cumulative, in KV blocks;
        cuda_graph_bytes is the device memory the decode graphs took when captured at load."""
        pc = self.block_manager.prefix_cache
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.swapped),
                "kv_usage": self.block_manager.usage, "num_preemptions": self.scheduler.num_preemptions,
                "num_swapped_out": self.scheduler.num_swapped_out,
                "prefix_cache_queries": pc.queries if pc else 0, "prefix_cache_hits": pc.hits if pc else 0,
                "prefix_cache_hit_rate": pc.hits / pc.queries if pc and pc.queries else 0.0,
                "cuda_graph_bytes": self.runner.graph_runner.memory_bytes if self.runner.graph_runner else 0,
                "spec_num_draft_tokens": self.num_draft_tokens, "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                         if self.num_draft_tokens else 0.0),
                "num_nonfinite_logits": self.num_nonfinite_logits}


def _copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """A host copy of `tokens` that does not wait for the device: pinned memory filled by an async copy, and
    the event that marks it complete. On CPU the tensor is its own copy."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _sub_batch(batch: ScheduledBatch, indices: list[int]) -> ScheduledBatch:
    """The sequences `indices` (ascending) of `batch`, decodes still first; no swaps (the batch did them)."""
    return ScheduledBatch(seqs=[batch.seqs[i] for i in indices],
                          num_new_tokens=[batch.num_new_tokens[i] for i in indices],
                          num_decodes=sum(1 for i in indices if i < batch.num_decodes))


def _latest(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request (a step that reads back step N and then runs N+1 synchronously has two; they
    are cumulative, so the later one says everything)."""
    return list({out.request_id: out for out in outputs}.values())
