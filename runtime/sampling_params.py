"""SamplingParams: how one request is decoded (vLLM-compatible names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import RequestError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Validated on construction; every bad value raises `RequestError` naming the field.

    `top_k` of -1 or 0 means off. `max_tokens=None` means "up to max_model_len". With `n > 1` and a
    `seed`, completion i is drawn from a generator seeded with `seed + i` so the n samples differ but stay
    reproducible. `logprobs` / `prompt_logprobs` ask for the top-N log-probabilities (of the raw logits,
    before penalties and temperature) in addition to the chosen / actual token.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise RequestError("stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        if self.temperature < _GREEDY_EPS:  # greedy: the filters cannot change an argmax
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise RequestError(f"{name} must be a number, got {value!r}")
