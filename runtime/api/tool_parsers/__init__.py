"""Tool calling, one module per model family behind a registry (as vLLM's tool_parsers/): a family's parser turns
model output into OpenAI `tool_calls`, whole or as streamed deltas (base.py: what the families share;
json_scan.py: the JSON prefix scanner streaming needs); `tool_choice` becomes a grammar in the family's format
(grammar.py), or, without one, the calls' JSON itself (json_choice.py, the "json" parser). A family's module is imported the first time its parser is asked for (`get_tool_parser`), not
when this package is. Chat-template rendering is api/chat_template.py."""
from __future__ import annotations

from ..parser_registry import ParserRegistry
from .base import DeltaMessage, ToolCall, ToolCallDelta, ToolCallStream, ToolParser, ToolParseResult
from .grammar import TOOL_ARGS_MAX_WHITESPACE, check_tools, tool_choice_grammar
from .json_scan import COMPLETE, INVALID, PARTIAL, scan_json, scan_members

__all__ = ["COMPLETE", "INVALID", "PARTIAL", "TOOL_ARGS_MAX_WHITESPACE", "TOOL_PARSERS", "DeltaMessage", "ToolCall",
           "ToolCallDelta", "ToolCallStream", "ToolParseResult", "ToolParser", "check_tools", "get_tool_parser",
           "json_tool_choice", "register_tool_parser", "scan_json", "scan_members", "tool_choice_grammar",
           "tool_parser_for", "tool_parser_names"]

TOOL_PARSERS = ParserRegistry("tool parser")
register_tool_parser = TOOL_PARSERS.register

TOOL_PARSERS.register_lazy(("hermes", "qwen", "qwen2_5", "qwen3"), f"{__name__}.hermes", "HermesToolParser")
TOOL_PARSERS.register_lazy(("llama3_json", "llama"), f"{__name__}.llama3_json", "Llama3JsonToolParser")
TOOL_PARSERS.register_lazy(("mistral",), f"{__name__}.mistral", "MistralToolParser")
TOOL_PARSERS.register_lazy(("deepseek_v3", "deepseek_r1"), f"{__name__}.deepseek_v3", "DeepSeekV3ToolParser")
# no family format: tool_choice "required" / a named function constrained to the calls' JSON (json_choice.py)
TOOL_PARSERS.register_lazy(("json",), f"{__name__}.json_choice", "JsonToolParser")


def json_tool_choice(tools: list[dict], tool_choice: object, *, parallel_tool_calls: bool = True,
                     whitespace: str = "compact") -> tuple:
    """(GrammarSpec, ToolParser) constraining a forced `tool_choice` to the calls' JSON, for a model without a
    tool format (json_choice.JsonToolParser.for_choice)."""
    return TOOL_PARSERS.get_class("json").for_choice(tools, tool_choice, parallel_tool_calls=parallel_tool_calls,
                                                     whitespace=whitespace)


def tool_parser_names() -> list[str]:
    return TOOL_PARSERS.names()


def get_tool_parser(name: str) -> ToolParser:
    """`kiln serve --tool-parser NAME`; raises RequestError for an unknown name."""
    return TOOL_PARSERS.get(name)


# A chat template writes the markers its model was trained on; first match wins (Qwen's templates contain no
# other family's markers, Llama's contains "<|python_tag|>").
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("<|python_tag|>", "llama3_json"))


def tool_parser_for(chat_template: str | None) -> str | None:
    """The parser a checkpoint's chat template implies, or None (the model has no tool format kiln knows)."""
    if not chat_template:
        return None
    for marker, name in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return name
    return None
