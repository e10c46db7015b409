"""LLMEngine: the engine core driven in-process, its token deltas turned into RequestOutputs (text, stops)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .api.output_processor import OutputProcessor
from .artifact import LoadedArtifact
from .core.engine import EngineCore
from .errors import RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLMEngine(EngineCore):
    """An `EngineCore` whose `step()` returns `RequestOutput`s, as vLLM's LLMEngine: the core's deltas go
    through the same `OutputProcessor` the API server uses, with no process or socket in between. `LLM`, the
    CLI's `generate`, benchmarks and tests drive it.

    `output_kind="cumulative"`: `step()` returns the output of every request that progressed; "final": only
    of those that finished (offline `LLM.generate` reads nothing else, and is spared the per-step copies).
    `abort_request` ends a request; its final output (finish_reason "abort") comes from the next `step()`.
    """

    def __init__(self, artifact: LoadedArtifact | str | Path, *, output_kind: str = "cumulative",
                 **core_kwargs: Any) -> None:
        if output_kind not in ("cumulative", "final"):
            raise RequestError(f"unknown output_kind {output_kind!r} (known: cumulative, final)")
        super().__init__(artifact, **core_kwargs)
        self.output_kind = output_kind
        self.output_processor = OutputProcessor(self.tokenizer)
        self._aborted: list[RequestOutput] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, prompt: str | None = None, priority: int = 0, lora_name: str | None = None) -> None:
        """Queues a request; raises `RequestError` (nothing queued) when it can never be served."""
        params = params or SamplingParams()
        super().add_request(request_id, prompt_token_ids, params, priority=priority, lora_name=lora_name)
        self.output_processor.add_request(request_id, list(prompt_token_ids), params, prompt)

    def abort_request(self, request_id: str) -> None:
        super().abort_request(request_id)
        state = self.output_processor.abort_request(request_id)
        if state is not None:
            self._aborted.append(self.output_processor.snapshot(state))

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """One core step, its deltas processed: ended (aborted) requests' outputs first, then every request
        that progressed (output_kind "final": that finished)."""
        processed = self.output_processor.process(super().step())
        if processed.finish_in_core:
            self.finish_sequences(processed.finish_in_core)
        for request_id in processed.abort_in_core:
            EngineCore.abort_request(self, request_id)
        outputs, self._aborted = self._aborted, []
        final_only = self.output_kind == "final"
        snapshot = self.output_processor.snapshot
        for state in processed.touched:
            if state.finished or not final_only:
                outputs.append(snapshot(state))
        return outputs

    def drain_aborted(self) -> list[RequestOutput]:
        """Drops what ended outside a step (aborted, failed) and has not been returned yet."""
        outputs, self._aborted = self._aborted, []
        self.take_pending()
        return outputs
