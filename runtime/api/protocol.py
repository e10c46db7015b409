"""OpenAI API request schemas (strict: a wrong type is a 400, never coerced) and the error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import RequestError
from ..sampling_params import SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered with OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_supported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported yet", param=param, code="unsupported_parameter")


class StrictModel(BaseModel):
    """A request body that rejects unknown fields, coercion and non-finite numbers (the Responses API's too)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(StrictModel):
    """Fields both endpoints share; vLLM's extensions (top_k, min_p, ...) ride along as in vLLM. Types are
    checked here; the numbers' ranges in `SamplingParams` (the one place that bounds them, for the server and
    for offline use alike) and against the model in `LLMEngine.add_request`."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's text / json_object / json_schema and kiln's regex / choice / grammar / structural_tag, checked by
    # grammar_spec.grammar_spec_from_response_format (chat_plan.validated_grammar)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's: keys the prompt's prefix-cache blocks, so requests with other salts never share them
    cache_salt: str | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def token_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys (token ids, JSON object keys are strings) as ints; ranges are checked by
        SamplingParams and against the vocabulary by the engine."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r:.60}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **more: Any) -> SamplingParams:
        """Raises `RequestError` naming the bad field; `more` overrides (n, prompt_logprobs)."""
        given = {k: v for k, v in (
            ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
            ("min_p", self.min_p), ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty), ("repetition_penalty", self.repetition_penalty))
            if v is not None}
        return SamplingParams(**{"n": self.n, "max_tokens": max_tokens, "seed": self.seed, "stop": self.stop,
                                 "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                                 "skip_special_tokens": self.skip_special_tokens, "logprobs": logprobs,
                                 "logit_bias": self.token_logit_bias(), "cache_salt": self.cache_salt,
                                 **given, **more})


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise not_supported("suffix", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt alone)",
                           param="max_tokens")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise APIError(400, f"best_of must be in [n, {MAX_N}] (n={self.n}), got {self.best_of}",
                               param="best_of")
            if self.stream and self.best_of > self.n:
                raise APIError(400, "best_of greater than n cannot be streamed (the best completions are known "
                               "only once all are done)", param="best_of")

    @property
    def num_sequences(self) -> int:
        """How many completions the engine generates per prompt: best_of, of which the n best are returned."""
        return self.best_of or self.n

    def engine_params(self) -> SamplingParams:
        """What the engine runs: `best_of` completions (scored by their cumulative logprob, so logprobs are
        computed when best_of > n), the prompt's logprobs for `echo` with `logprobs`, and at least one token:
        `max_tokens: 0` (echo only) generates one that the answer leaves out, so every prefill still ends in a
        sample, which the engine core relies on."""
        logprobs = self.logprobs
        if logprobs is None and self.num_sequences > self.n:
            logprobs = 0
        return self.sampling_params(1 if self.max_tokens == 0 else self.max_tokens, logprobs,
                                    n=self.num_sequences,
                                    prompt_logprobs=self.logprobs if self.echo else None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: text or token ids each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # an earlier turn's thinking, for templates that keep it

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template sees it: text content parts joined by newlines; an assistant's
    `tool_calls` are made template-ready by chat_template.prepare_messages."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise not_supported(f"messages.{index}.content.{i}", f"content part of type {part.type!r}")
                texts.append(part.text)
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # none / minimal / low / medium / high: a thinking budget
    max_thinking_tokens: int | None = None  # kiln: the thinking budget in tokens (wins over reasoning_effort)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_params(self) -> SamplingParams:
        return self.sampling_params(self.resolved_max_tokens(), self.num_logprobs())


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a `prompt` (special tokens added by default), or chat `messages` rendered by the chat
    template (special tokens not added by default: the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def request_error_param(error: RequestError, fields: set[str]) -> str | None:
    """SamplingParams and the engine start their messages with the offending field's name."""
    head = str(error).split(" ", 1)[0].split("=", 1)[0]
    return head if head in fields else None
