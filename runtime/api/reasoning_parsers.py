"""Reasoning models: the API server splits `<think>…</think>` (or the family's equivalent) into reasoning and
content, whole or streamed. The token-level side (the thinking budget, the block's token ids, the tracker that
forces its end) is shared with the engine core: runtime/thinking.py."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from .parser_registry import ParserRegistry, held_prefix


@dataclass(slots=True)
class ReasoningResult:
    """`reasoning` is None when the output has no thinking block (or an empty one)."""

    reasoning: str | None
    content: str | None


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _Phase(enum.Enum):
    UNDECIDED = "undecided"  # nothing but whitespace (or part of the start tag) seen yet
    THINKING = "thinking"
    AFTER_END = "after_end"  # the end tag was seen: newlines before the answer are dropped
    CONTENT = "content"


class ReasoningStream:
    """Splits one output incrementally. `feed(delta)` returns the reasoning and content text that is certain
    now; text that may still turn out to be a tag (or newlines next to one) is held back until the next delta
    or `finish()`. Every decision depends on the text alone, not on where the deltas split it, so the
    concatenated deltas equal `ReasoningParser.parse` of the whole text.

    Reasoning is returned without the tags and without the newlines that templates put just inside them;
    content without the newlines after the end tag. Output with no start tag (and a prompt that did not open
    the block) is all content.
    """

    def __init__(self, start: str, end: str, prompt_in_thinking: bool) -> None:
        self.start, self.end = start, end
        self._phase = _Phase.THINKING if prompt_in_thinking else _Phase.UNDECIDED
        self._pending = ""
        self._reasoning_begun = False  # a non-newline reasoning character was emitted

    def feed(self, delta: str) -> ReasoningDelta:
        self._pending += delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            text = self._pending
            if self._phase is _Phase.UNDECIDED:
                body = text.lstrip()
                if body.startswith(self.start):
                    self._phase, self._pending = _Phase.THINKING, body[len(self.start):]
                    continue
                if not final and self.start.startswith(body):
                    return out  # whitespace or part of the start tag: wait
                self._phase = _Phase.CONTENT
                continue
            if self._phase is _Phase.THINKING:
                at = text.find(self.end)
                if at >= 0:
                    out.reasoning += self._reasoning_text(text[:at].rstrip("\n"))
                    self._phase, self._pending = _Phase.AFTER_END, text[at + len(self.end):]
                    continue
                if final:  # the block never closed (the output was cut): all of it is reasoning
                    out.reasoning += self._reasoning_text(text)
                    self._pending = ""
                    return out
                emit = text[:len(text) - held_prefix(text, self.end)]
                kept = emit.rstrip("\n")  # newlines just before the end tag are dropped: hold them
                out.reasoning += self._reasoning_text(kept)
                self._pending = text[len(kept):]
                return out
            if self._phase is _Phase.AFTER_END:
                body = text.lstrip("\n")
                if not body and not final:
                    self._pending = ""
                    return out
                self._phase, self._pending = _Phase.CONTENT, body
                continue
            out.content += text
            self._pending = ""
            return out

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip("\n")
            self._reasoning_begun = bool(text)
        return text


class ReasoningParser:
    """A family's thinking-block tags. `prompt_in_thinking`: the rendered prompt already opened the block
    (thinking-by-default templates end the prompt with `<think>\\n`), so the output starts inside it.

    Contract: never raises on model output; `parse(text)` equals the concatenation of a stream's deltas."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def stream(self, prompt_in_thinking: bool = False) -> ReasoningStream:
        return ReasoningStream(self.start, self.end, prompt_in_thinking)

    def parse(self, text: str, prompt_in_thinking: bool = False) -> ReasoningResult:
        stream = self.stream(prompt_in_thinking)
        a, b = stream.feed(text), stream.finish()
        reasoning, content = a.reasoning + b.reasoning, a.content + b.content
        return ReasoningResult(reasoning or None, content or None)

    def prompt_phase(self, prompt: str) -> str:
        """Where the rendered prompt leaves the output: "thinking" (the prompt opened a block it did not
        close), "answer" (it closed one: Qwen3's `enable_thinking=False` renders an empty block) or "maybe"
        (the model may open one itself)."""
        opened, closed = prompt.rfind(self.start), prompt.rfind(self.end)
        if opened > closed and not prompt[opened + len(self.start):].strip():
            return "thinking"
        if closed > opened and not prompt[closed + len(self.end):].strip():
            return "answer"
        return "maybe"


REASONING_PARSERS = ParserRegistry("reasoning parser")
register_reasoning_parser = REASONING_PARSERS.register


@register_reasoning_parser("qwen3", "deepseek_r1", "think")
class ThinkTagReasoningParser(ReasoningParser):
    """`<think>…</think>`: Qwen3 (hybrid and thinking-2507), QwQ, DeepSeek-R1 and its distills, GLM-4.5+."""


@register_reasoning_parser("mistral")
class MistralReasoningParser(ReasoningParser):
    """Magistral's `[THINK]…[/THINK]`."""

    start, end = "[THINK]", "[/THINK]"


def get_reasoning_parser(name: str) -> ReasoningParser:
    """`kiln serve --reasoning-parser NAME`; raises RequestError for an unknown name."""
    return REASONING_PARSERS.get(name)


def reasoning_parser_for(chat_template: str | None) -> str | None:
    """The parser a checkpoint's chat template implies (it writes the tags it trained on), or None."""
    if not chat_template:
        return None
    if "[THINK]" in chat_template:
        return "mistral"
    if "</think>" in chat_template:
        return "think"
    return None
