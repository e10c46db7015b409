"""`tool_choice` as a grammar: required / named (and `auto` with a strict tool) becomes an xgrammar structural
tag in the family's native format (`ToolParser.structural_tag`), so it is enforced rather than hoped for."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import RequestError
from ...grammar_spec import GrammarSpec

if TYPE_CHECKING:
    from .base import ToolParser

# Whitespace bound inside constrained tool arguments (see core/structured_output.GrammarBackend.max_whitespace)
TOOL_ARGS_MAX_WHITESPACE = 8


def check_tools(tools: list[dict] | None, tool_choice: Any = "auto") -> None:
    """Validates OpenAI `tools` / `tool_choice` (shapes, a named function that exists, "required" with tools)
    with xgrammar's OpenAI models; raises RequestError (a 400)."""
    from xgrammar import normalize_tool_choice

    try:
        normalize_tool_choice(tools or [], tool_choice)
    except Exception as e:  # ValueError, pydantic.ValidationError
        first = str(e).strip().splitlines()
        raise RequestError(f"invalid tools / tool_choice: {first[0] if first else type(e).__name__}") from None


def tool_choice_grammar(parser: ToolParser, tools: list[dict] | None, tool_choice: Any = "auto", *,
                        parallel_tool_calls: bool = True, reasoning: str = "disabled") -> GrammarSpec | None:
    """What enforces `tool_choice`: "required" and a named function always get the family's structural tag;
    "auto" only when a tool asks for `strict: true` (free text, but a call that begins is constrained);
    "none" and plain "auto" constrain nothing. Raises RequestError on invalid tools."""
    check_tools(tools, tool_choice)
    if not tools or tool_choice == "none":
        return None
    if tool_choice in ("auto", None) and not any(
            isinstance(t, dict) and (t.get("function") or {}).get("strict") is True for t in tools):
        return None
    if not parser.has_structural_tag:
        raise RequestError(f"tool_choice={tool_choice!r} needs a grammar for the {parser.name} format, which kiln "
                           "does not have")
    try:
        tag = parser.structural_tag(tools, "auto" if tool_choice is None else tool_choice,
                                    parallel_tool_calls=parallel_tool_calls, reasoning=reasoning)
    except ValueError as e:
        raise RequestError(f"invalid tools / tool_choice: {e}") from None
    return GrammarSpec.structural_tag(tag)
