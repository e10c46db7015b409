"""Request outputs, shaped like vLLM's so that client code ports unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "error": the engine failed this request (its logits were not finite, or a step failed on it); see
# RequestOutput.error.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token; `rank` is 1-based among the vocabulary (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: the chosen (or actual prompt) token plus the top-N, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for eos

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Cumulative state of one request. `prompt_logprobs[0]` is None: the first token has no context. `error`
    says why the engine failed the request (its completions then finish with "error"); None otherwise."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None


@dataclass(slots=True)
class CompletionDelta:
    """What one of a request's `n` completions produced since its previous delta (streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestDelta:
    """The new part of a request's output; `error` is set when it failed (it then finished). `prompt_logprobs`:
    the prompt positions whose logprobs arrived since the previous delta (the first delta's start with None,
    position 0's), when the request asked for them. `embedding`: an embedding artifact's result (task = embed), on
    the request's final delta."""

    request_id: str
    completions: list[CompletionDelta]
    num_prompt_tokens: int
    finished: bool
    error: BaseException | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    embedding: list[float] | None = None
