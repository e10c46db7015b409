"""Reasoning models: the API server splits `<think>…</think>` (or the family's equivalent) into reasoning and
content, whole or streamed; the engine tracks each sequence's thinking block token by token (where it ends, how
many tokens it took) and forces its end at a thinking budget, so the answer still comes."""
from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import ClassVar

from ..errors import RequestError

# API server: text ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReasoningResult:
    """`reasoning` is None when the output has no thinking block (or an empty one)."""

    reasoning: str | None
    content: str | None


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that may still become
    the marker, so a stream holds it back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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


class ParserRegistry:
    """Parser classes by name (reasoning parsers here, tool parsers in tool_parsers): `register(*names)`
    decorates a class (its first name becomes `cls.name`), `get(name)` instantiates one or raises
    RequestError naming the known ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._classes: dict[str, type] = {}

    def register(self, *names: str):
        def decorator(cls: type) -> type:
            cls.name = names[0]
            for n in names:
                self._classes[n] = cls
            return cls
        return decorator

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str):
        cls = self._classes.get(name)
        if cls is None:
            raise RequestError(f"unknown {self.what} {name!r} (known: {', '.join(self.names())})")
        return cls()


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


# Thinking budgets ----------------------------------------------------------------------------------------------

# reasoning_effort -> thinking budget in tokens (vLLM's proposal, #20859); "none"/"minimal" close the block at once.
# A recipe's `serve { reasoning_effort = { low: 512, ... } }` and `kiln serve --reasoning-effort low=512,...`
# change entries or add efforts (effort_budgets).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 2048, "high": 8192}
_EFFORT_NAME = re.compile(r"[a-z][a-z0-9_]*")


def effort_budgets(*overrides: dict[str, int] | None) -> dict[str, int]:
    """EFFORT_BUDGETS with `overrides` applied in order (later ones win); RequestError for a bad entry."""
    table = dict(EFFORT_BUDGETS)
    for entries in overrides:
        for name, budget in (entries or {}).items():
            if not isinstance(name, str) or not _EFFORT_NAME.fullmatch(name):
                raise RequestError(f"reasoning effort names are lower-case words such as low or high, got {name!r}")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise RequestError(f"the thinking budget of reasoning effort {name!r} must be an integer >= 0 "
                                   f"(tokens), got {budget!r}")
            table[name] = budget
    return table


def parse_effort_budgets(text: str) -> dict[str, int]:
    """`kiln serve --reasoning-effort low=512,high=4096`: the entries given; RequestError when malformed."""
    entries: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise RequestError(f"--reasoning-effort takes EFFORT=TOKENS entries separated by commas (e.g. "
                               f"low=512,high=4096), got {item!r}")
        entries[name.strip()] = int(value)
    effort_budgets(entries)  # checks the names
    return entries


def thinking_budget(reasoning_effort: str | None = None, max_thinking_tokens: int | None = None,
                    efforts: dict[str, int] | None = None) -> int | None:
    """The request's budget: kiln's `max_thinking_tokens` if given, else the effort's, else None (no budget).
    Raises RequestError (a 400) on a bad value."""
    if max_thinking_tokens is not None:
        if not isinstance(max_thinking_tokens, int) or isinstance(max_thinking_tokens, bool) or max_thinking_tokens < 0:
            raise RequestError(f"max_thinking_tokens must be an integer >= 0, got {max_thinking_tokens!r}")
        return max_thinking_tokens
    if reasoning_effort is None:
        return None
    table = efforts or EFFORT_BUDGETS
    if reasoning_effort not in table:
        raise RequestError(f"reasoning_effort must be one of {', '.join(table)}, got {reasoning_effort!r}")
    return table[reasoning_effort]


class ThinkPhase(enum.IntEnum):
    MAYBE = 0  # output not begun; the model may open a block (a single-token start tag) or answer directly
    THINKING = 1
    ANSWER = 2


@dataclass(frozen=True, slots=True)
class ThinkingConfig:
    """Token ids of a sequence's thinking block, resolved once per tokenizer: `start_ids` (the start tag; only
    a single-token one can be recognised when the model opens the block itself), `end_ids` (the end tag),
    `force_ids` (what a budget forces: typically "\\n" + end tag), the phase the prompt leaves the output in,
    and the budget (None: unlimited)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    force_ids: tuple[int, ...]
    phase: ThinkPhase = ThinkPhase.THINKING
    budget: int | None = None

    def __post_init__(self) -> None:
        assert self.end_ids, "a thinking block needs an end tag"
        assert self.force_ids[-len(self.end_ids):] == self.end_ids, "the forced sequence must end with the end tag"

    @classmethod
    def from_tokenizer(cls, tokenizer, parser: ReasoningParser, *, phase: ThinkPhase | str = ThinkPhase.THINKING,
                       budget: int | None = None, force_text: str | None = None) -> ThinkingConfig:
        """`tokenizer.encode(text, add_special_tokens=False)` gives the ids (kiln's Tokenizer or an HF one)."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(phase, str):
            phase = {"thinking": ThinkPhase.THINKING, "answer": ThinkPhase.ANSWER, "maybe": ThinkPhase.MAYBE}[phase]
        end = ids(parser.end)
        force = ids(force_text) if force_text is not None else ids("\n") + end
        if force[-len(end):] != end:  # "\n" merged into the tag's first token: force the tag alone
            force = end
        return cls(ids(parser.start), end, force, phase, budget)


class ReasoningTracker:
    """The token-level state of one sequence's thinking block: its phase, its reasoning-token count (the
    start tag when the model wrote it, the thinking, and the end tag), and whether the next token must be
    forced. `accept(t)` returns whether `t` belongs to the answer (what a grammar constrains).

    Budget: once one more free token could leave too little room for force_ids, the rest of force_ids is
    forced one token per step, so the reasoning tokens never exceed max(budget, len(force_ids)). A forced
    sequence the model has already begun (a "\\n" it just wrote) is continued, not restarted.
    `rollback(n)` undoes the last n accepts (speculative drafts); it reaches back `history` tokens.
    """

    __slots__ = ("config", "phase", "count", "_tail", "_history")

    def __init__(self, config: ThinkingConfig, history: int = 64) -> None:
        self.config = config
        self.phase = config.phase
        if self.phase is ThinkPhase.MAYBE and len(config.start_ids) != 1:
            self.phase = ThinkPhase.ANSWER  # a multi-token start tag cannot be told from an answer's first token
        self.count = 0
        self._tail: tuple[int, ...] = ()  # the last tokens, as many as force_ids has
        self._history: deque[tuple[ThinkPhase, int, tuple[int, ...]]] = deque(maxlen=history)

    @property
    def in_thinking(self) -> bool:
        return self.phase is ThinkPhase.THINKING

    @property
    def may_open(self) -> int | None:
        """The start tag's id while the model may still open a block (a grammar must allow it), else None."""
        return self.config.start_ids[0] if self.phase is ThinkPhase.MAYBE else None

    def accept(self, token: int) -> bool:
        cfg = self.config
        self._history.append((self.phase, self.count, self._tail))
        if self.phase is ThinkPhase.ANSWER:
            return True
        if self.phase is ThinkPhase.MAYBE:
            if token != cfg.start_ids[0]:
                self.phase = ThinkPhase.ANSWER
                return True
            self.phase, self.count = ThinkPhase.THINKING, 1
            return False
        self.count += 1
        self._tail = (self._tail + (token,))[-len(cfg.force_ids):]
        if self._tail[-len(cfg.end_ids):] == cfg.end_ids:
            self.phase = ThinkPhase.ANSWER
        return False

    def _forced_progress(self) -> int:
        """How many leading tokens of force_ids the output already ends with."""
        force, tail = self.config.force_ids, self._tail
        for k in range(min(len(force), len(tail)), 0, -1):
            if tail[-k:] == force[:k]:
                return k
        return 0

    def forced_token(self) -> int | None:
        """The token the budget forces next, or None."""
        budget = self.config.budget
        if budget is None or self.phase is not ThinkPhase.THINKING:
            return None
        # Not forcing now lets one free token in, which may break a forced sequence already begun: so force
        # once a free token would leave too little room for the whole sequence after it.
        if self.count + 1 + len(self.config.force_ids) <= budget:
            return None
        return self.config.force_ids[self._forced_progress()]

    def rollback(self, n: int) -> None:
        assert 0 <= n <= len(self._history), f"rollback of {n} tokens, history holds {len(self._history)}"
        for _ in range(n):
            self.phase, self.count, self._tail = self._history.pop()


def count_reasoning_tokens(config: ThinkingConfig, output_token_ids: Seq[int]) -> int:
    """usage.completion_tokens_details.reasoning_tokens of a finished output (what the engine's tracker
    counted, recomputed from the tokens on the API server's side)."""
    tracker = ReasoningTracker(config, history=1)
    for t in output_token_ids:
        tracker.accept(t)
        if tracker.phase is ThinkPhase.ANSWER:
            break
    return tracker.count
