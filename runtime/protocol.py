"""OpenAI API request schemas (strict: a wrong type is a 400, never coerced) and the error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import RequestError
from .sampling_params import SamplingParams

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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
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

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise not_supported("logit_bias", "logit_bias")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises `RequestError` naming the bad field."""
        given = {k: v for k, v in (
            ("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
            ("min_p", self.min_p), ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty), ("repetition_penalty", self.repetition_penalty))
            if v is not None}
        return SamplingParams(n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, **given)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise not_supported("echo", "echo")
        if self.suffix:
            raise not_supported("suffix", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise not_supported("best_of", "best_of other than n")

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # an earlier turn's thinking, for templates that keep it

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template sees it: text content parts joined by newlines; an assistant's
    `tool_calls` are made template-ready by tool_parsers.prepare_messages."""
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


def request_error_param(error: RequestError, fields: set[str]) -> str | None:
    """SamplingParams and the engine start their messages with the offending field's name."""
    head = str(error).split(" ", 1)[0].split("=", 1)[0]
    return head if head in fields else None
