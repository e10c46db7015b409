"""The engine core's constrained decoding: requests whose `SamplingParams` carry a grammar (`structured_output`)
or a thinking budget (`thinking`), from `add_request` to their last token.

* A grammar compiles off the step loop (`GrammarBackend.compile_async`, a thread pool; a cache hit is done at
  once). Until it has, the request's sequences wait outside the scheduler (status PENDING): they hold no KV and
  never delay a step of the others. A grammar that fails to compile, or takes longer than `compile_timeout`,
  fails its request alone with the reason.
* Compiled, the request is registered with the `StructuredOutputProcessor`, the sampler's logits processor:
  each step it fills one bitmask for all constrained rows and applies it to those rows only. Nothing is built
  (no xgrammar tokenizer info, no processor) before the first constrained request, and a step without one
  costs a dict check.
* A constrained sequence must see its previous token before its next is sampled, so while any is registered
  the engine steps synchronously (`active`; async scheduling resumes once they finish), and speculative drafts
  are verified against the grammar (`SpeculativeDecoder.verify` calls the processor's `mask_drafts`).
* A sequence whose grammar rejected a token (it cannot happen through the mask; a bug would) fails its request
  with an error rather than going on unconstrained (`after_step`).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RequestError
from ..grammar_spec import GrammarError
from ..sampling_params import SamplingParams
from ..thinking import ThinkingConfig
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .engine import EngineCore
    from .structured_output import GrammarBackend, StructuredOutputProcessor

IDLE_WAIT_S = 0.005  # with nothing else to run, a step waits this long for a compile to finish


@dataclass(slots=True)
class _Pending:
    future: Future
    since: float
    seqs: list[Sequence]
    thinking: ThinkingConfig | None


class ConstraintManager:
    """`max_whitespace`: the most whitespace characters a JSON grammar allows in a row (None: unbounded; small
    models spend their tokens on whitespace wherever a grammar allows it); `compile_timeout` in seconds;
    `cache_size`: compiled grammars kept (LRU)."""

    def __init__(self, engine: EngineCore, *, max_whitespace: int | None = 8, compile_timeout: float = 10.0,
                 cache_size: int = 128) -> None:
        self._engine = engine
        self.max_whitespace, self.compile_timeout, self.cache_size = max_whitespace, compile_timeout, cache_size
        self.backend: GrammarBackend | None = None
        self.processor: StructuredOutputProcessor | None = None
        self._pending: dict[str, _Pending] = {}
        self.num_compile_errors = 0

    @staticmethod
    def constrains(params: SamplingParams) -> bool:
        """Whether the engine must mask this request's logits (a thinking block without a budget needs nothing)."""
        return params.structured_output is not None or (params.thinking is not None
                                                        and params.thinking.budget is not None)

    @property
    def active(self) -> bool:
        """A registered request may be sampled in the next step: the engine must step synchronously."""
        return self.processor is not None and self.processor.num_requests > 0

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def _processor(self, with_grammar: bool) -> StructuredOutputProcessor:
        from .structured_output import GrammarBackend, StructuredOutputProcessor, eos_token_ids

        engine = self._engine
        if with_grammar and self.backend is None:
            if engine.tokenizer is None:
                raise RequestError("structured_output needs the model's tokenizer, and this artifact has none")
            self.backend = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size,
                                          eos_token_ids(engine.stops.eos_token_ids, engine.tokenizer),
                                          cache_size=self.cache_size, max_whitespace=self.max_whitespace,
                                          compile_timeout=self.compile_timeout)
            if self.processor is not None:
                self.processor.backend = self.backend
        if self.processor is None:
            self.processor = StructuredOutputProcessor(self.backend, engine.model_config.vocab_size,
                                                       device=engine.artifact.device)
            engine.sampler.logits_processor = self.processor
        return self.processor

    def add(self, request_id: str, params: SamplingParams, seqs: list[Sequence]) -> bool:
        """Takes a new request's constraints; True when its sequences wait for their grammar (`admit` queues
        them), False when the engine queues them now. Raises RequestError (nothing kept)."""
        if not self.constrains(params):
            return False
        processor = self._processor(params.structured_output is not None)
        if params.structured_output is None:
            processor.add_request(request_id, thinking=params.thinking)
            return False
        future = self.backend.compile_async(params.structured_output)
        for seq in seqs:
            seq.status = SequenceStatus.PENDING
        self._pending[request_id] = _Pending(future, time.monotonic(), seqs, params.thinking)
        return True

    def admit(self) -> None:
        """Before a step: queues the requests whose grammar is compiled, fails those whose grammar failed."""
        if not self._pending:
            return
        engine = self._engine
        if not engine.scheduler.has_unfinished():  # nothing else to run: wait for a compile, briefly
            wait_futures([p.future for p in self._pending.values()], IDLE_WAIT_S, FIRST_COMPLETED)
        now = time.monotonic()
        for request_id, p in list(self._pending.items()):
            if request_id not in engine.requests or all(s.is_finished for s in p.seqs):  # aborted meanwhile
                del self._pending[request_id]
                continue
            if not p.future.done():
                if now - p.since > self.compile_timeout:
                    del self._pending[request_id]
                    self._fail(request_id, f"compiling the grammar took longer than {self.compile_timeout:g} s; "
                               "simplify the schema (deeply nested anyOf/oneOf compile slowly)")
                continue
            del self._pending[request_id]
            try:
                compiled = p.future.result()
            except GrammarError as e:
                self._fail(request_id, str(e))
                continue
            except Exception as e:  # xgrammar failed otherwise: still this request's failure alone
                self._fail(request_id, f"compiling the grammar failed: {type(e).__name__}: {e}")
                continue
            self.processor.add_request(request_id, grammar=compiled, thinking=p.thinking)
            for seq in p.seqs:
                engine.scheduler.add(seq)

    def _fail(self, request_id: str, why: str) -> None:
        self.num_compile_errors += 1
        self._engine.end_request(request_id, "error", why)

    def after_step(self) -> None:
        """Fails the requests whose grammar rejected a token and forgets the ones that ended."""
        processor = self.processor
        if processor is None or not processor.num_requests:
            return
        engine = self._engine
        for (request_id, _), why in processor.errors().items():
            engine.end_request(request_id, "error", f"constrained decoding failed: {why}")
        for request_id in processor.request_ids():
            if request_id not in engine.requests:
                processor.remove_request(request_id)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def stats(self) -> dict[str, Any]:
        p = self.processor
        return {"num_constrained_requests": p.num_requests if p else 0,
                "num_grammar_pending": len(self._pending), "num_grammar_errors": self.num_compile_errors,
                "num_masked_rows": p.num_masked_rows if p else 0}
