"""Thinking blocks, shared by the API server and the engine core: a request's thinking budget (from
`reasoning_effort` or `max_thinking_tokens`), the token ids of a sequence's block (`ThinkingConfig`, carried in
SamplingParams), and the tracker that follows the block token by token, counts its tokens and forces its end at
the budget (`ReasoningTracker`, in the core's structured output). The text-level parsers that split reasoning
from content are the API server's (api/reasoning_parsers.py)."""
from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from .errors import RequestError


class ThinkTags(Protocol):
    """A thinking block's start and end tags (a ReasoningParser has them)."""

    start: str
    end: str


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
    def from_tokenizer(cls, tokenizer, parser: ThinkTags, *, phase: ThinkPhase | str = ThinkPhase.THINKING,
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
