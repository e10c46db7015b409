"""SamplingParams: how one request is decoded (vLLM-compatible names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RequestError
from .grammar_spec import GrammarSpec
from .thinking import ThinkingConfig

_GREEDY_EPS = 1e-5
# What the sampler's int64 tensors (and torch.Generator seeds) hold. Floats are bounded below by far more than
# float32's range.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Bounds that keep every logit finite: the repetition penalty divides or multiplies logits by its value, a
# temperature divides them. Beyond 100 (or below 1/100) the penalty already decides the token on its own, and a
# temperature of 100 is uniform sampling in all but name.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Stop strings are searched for after every generated token of the request: their number and length bound that
# per-token cost, which every other sequence in the batch waits for.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 32, 512
# OpenAI's bounds on logit_bias: -100 bans a token, 100 all but forces it. The number of entries bounds the
# per-step cost of applying them (OpenAI allows 300 for its largest models; one per vocabulary entry is useless).
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES = 100.0, 1024
# A cache salt is hashed into the request's first prefix-cache key (block_hash.root_hash); a tenant id or a
# secret, never long.
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class SamplingParams:
    """Validated on construction (and again by `LLMEngine.add_request`, see `check`); every bad value raises
    `RequestError` whose message starts with the field's name.

    `top_k` of -1 or 0 means off (a value of at least the vocabulary size is off too). `max_tokens=None` means
    "up to max_model_len". With `n > 1` and a `seed`, completion i is drawn from a generator seeded with
    `seed + i` so the n samples differ but stay reproducible. `logprobs` / `prompt_logprobs` ask for the top-N
    log-probabilities (of the raw logits, before penalties and temperature) in addition to the chosen / actual
    token. Numbers are bounded to what the sampler's tensors hold (int64, finite float32) and to ranges that
    keep logits finite: temperature in [0, 100], repetition_penalty in [0.01, 100], presence and frequency
    penalties in [-2, 2]; at most 32 stop strings of at most 512 characters. `logit_bias` (token id -> bias in
    [-100, 100], at most 1024 entries) is added to the logits before anything else (penalties, constrained
    decoding masks, sampling); logprobs then see the biased logits.

    `structured_output` constrains the output to a grammar (a JSON schema, a regex, ...: grammar_spec.py), which
    the engine compiles before the request first runs; `thinking` names the thinking block's token ids, where
    the prompt leaves the output and a budget of reasoning tokens, at which the engine forces the block's end
    (thinking.ThinkingConfig). With both, the grammar constrains the answer after the block.

    `cache_salt` (vLLM's field; a non-empty string of at most 1024 characters) keys the request's prefix-cache
    blocks: requests with different salts (or one salted and one not) never share a cached block, so one tenant
    cannot read another's prompts through cache hits or their timing.
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
    structured_output: GrammarSpec | None = None
    thinking: ThinkingConfig | None = None
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Validates every field and normalizes the derived ones (idempotent). `LLMEngine.add_request` calls it
        again, so a SamplingParams changed after construction (or decoded from a message) is checked before
        its values reach a tensor."""
        _check_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise RequestError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=INT64_MIN)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                               f"characters, got {self.cache_salt!r:.60}")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_strings = list(self.stop)
        else:
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r:.200}")
        if any(s == "" for s in self.stop_strings):
            raise RequestError("stop strings must not be empty")
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                               "characters each")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not (isinstance(self.stop_token_ids, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in self.stop_token_ids)):
            raise RequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r:.200}")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.structured_output is not None and not isinstance(self.structured_output, GrammarSpec):
            raise RequestError(f"structured_output must be a GrammarSpec, got {type(self.structured_output).__name__}")
        if self.thinking is not None and not isinstance(self.thinking, ThinkingConfig):
            raise RequestError(f"thinking must be a ThinkingConfig, got {type(self.thinking).__name__}")
        self.stop_token_set = frozenset(self.stop_token_ids)  # checked after every token: no list scan
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


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must map token ids to numbers, got {bias!r:.100}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT64_MAX:
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got {token!r:.100}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                               f"got {value!r:.60} for token {token}")
    return {int(t): float(v) for t, v in bias.items()} or None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r:.100}")
    if not minimum <= value <= INT64_MAX:
        raise RequestError(f"{name} must be in [{minimum}, {INT64_MAX}], got {value}")


def _check_number(name: str, value: object, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RequestError(f"{name} must be a number, got {value!r:.100}")
    if not low <= value <= high:  # NaN fails every comparison
        raise RequestError(f"{name} must be in [{low:g}, {high:g}], got {value!r:.60}")
