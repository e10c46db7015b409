"""The API server's structured side of a request: what `response_format`, `tools` / `tool_choice` and
`reasoning_effort` / `max_thinking_tokens` ask of the engine (`RequestPlan`: a grammar and a thinking block,
carried to the core in SamplingParams) and how the output is split back into `reasoning_content`, `content`
and `tool_calls` (`ChoiceParser`, whole or streamed as deltas).

Malformed or unservable requests raise `PlanError` naming the request field (a 400): a schema xgrammar cannot
convert (its message), tools without a tool-call format for this model, a tool_choice naming no tool, ...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..grammar_spec import GrammarError, GrammarSpec, grammar_spec_from_response_format, validate
from ..thinking import ThinkingConfig, ThinkPhase, count_reasoning_tokens, thinking_budget
from .reasoning_parsers import ReasoningParser, get_reasoning_parser, reasoning_parser_for
from .tool_parsers import (
    ToolParser,
    check_tools,
    get_tool_parser,
    json_tool_choice,
    tool_choice_grammar,
    tool_parser_for,
)


class PlanError(RequestError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_parsers(tokenizer: Any, tool_parser: str | None = None,
                    reasoning_parser: str | None = None) -> tuple[ToolParser | None, ReasoningParser | None]:
    """`kiln serve --tool-parser / --reasoning-parser` (a registry name, or "none"), else what the checkpoint's
    chat template implies. Raises RequestError for an unknown name."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    tool_name = tool_parser if tool_parser is not None else tool_parser_for(template)
    reasoning_name = reasoning_parser if reasoning_parser is not None else reasoning_parser_for(template)
    return (get_tool_parser(tool_name) if tool_name not in (None, "none") else None,
            get_reasoning_parser(reasoning_name) if reasoning_name not in (None, "none") else None)


def requested_grammar(response_format: dict | None, whitespace: str = "compact") -> GrammarSpec | None:
    """`response_format` as a GrammarSpec, not yet validated: cheap (GrammarSpec bounds its size); PlanError for a
    malformed or oversized one. `whitespace`: the JSON kinds' policy (`kiln serve --json-whitespace`)."""
    try:
        return grammar_spec_from_response_format(response_format, whitespace)
    except GrammarError as e:
        raise PlanError(str(e), "response_format") from None


def check_grammar(spec: GrammarSpec) -> None:
    """PlanError unless xgrammar can convert `spec`: the costly part (seconds for a big schema), which the
    server runs off its event loop (serving.OpenAIServer.grammar)."""
    try:
        validate(spec)
    except GrammarError as e:
        raise PlanError(str(e), "response_format") from None


def validated_grammar(response_format: dict | None, whitespace: str = "compact") -> GrammarSpec | None:
    """`response_format` as a GrammarSpec that xgrammar can convert (PlanError otherwise)."""
    spec = requested_grammar(response_format, whitespace)
    if spec is not None:
        check_grammar(spec)
    return spec


@dataclass
class RequestPlan:
    """One chat (or completion) request's constraints and output parsing. `thinking` describes the thinking
    block whenever the model has one (reasoning tokens are counted with it); `send_thinking` says whether the
    core must track it too (a budget to force, or a grammar to hold back until the block ends)."""

    grammar: GrammarSpec | None = None
    tool_parser: ToolParser | None = None  # the output's calls are parsed (tools given, tool_choice not "none")
    reasoning: ReasoningParser | None = None
    single_call: bool = False  # parallel_tool_calls false: calls after the first are dropped (every mode)
    prompt_in_thinking: bool = False
    thinking: ThinkingConfig | None = None
    send_thinking: bool = False

    def sampling_fields(self) -> dict[str, Any]:
        """What SamplingParams carries to the core."""
        fields: dict[str, Any] = {}
        if self.grammar is not None:
            fields["structured_output"] = self.grammar
        if self.send_thinking:
            fields["thinking"] = self.thinking
        if self.tool_parser is not None and self.tool_parser.needs_special_tokens:
            fields["skip_special_tokens"] = False  # the format's markers are special tokens
        return fields

    def choice_parser(self) -> ChoiceParser:
        return ChoiceParser(self)

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        return count_reasoning_tokens(self.thinking, token_ids) if self.thinking is not None else 0


def plan_chat(req: Any, prompt: str, tokenizer: Any, tool_parser: ToolParser | None,
              reasoning_parser: ReasoningParser | None, efforts: dict[str, int] | None = None,
              grammar: GrammarSpec | None = None, json_whitespace: str = "compact") -> RequestPlan:
    """The plan of a ChatCompletionRequest whose rendered prompt is `prompt`; `efforts` maps reasoning_effort to
    a thinking budget (the server's table: thinking.EFFORT_BUDGETS with the recipe's and the flag's
    overrides); `grammar`: the request's response_format as the caller validated it (validated_grammar);
    `json_whitespace`: the server's JSON whitespace policy (tool calls constrained to their JSON).

    tool_choice "required" or a named function without a family format (no tool parser, or one without a
    grammar) is constrained to the calls' JSON (tool_parsers/json_choice.py); "auto" needs a family format."""
    plan = RequestPlan(grammar=grammar)
    tools = req.tools or None
    choice = req.tool_choice
    if tools and choice != "none":
        parallel = req.parallel_tool_calls is not False
        plan.single_call = not parallel
        forced = choice not in (None, "auto")
        no_format = tool_parser is None or getattr(tool_parser, "constrained_only", False)
        if no_format and not forced:
            raise PlanError("tool_choice 'auto' needs a tool-call format, and this model's chat template has none "
                            "kiln knows; start kiln serve with --tool-parser NAME, or send tool_choice 'required' "
                            "or a named function (constrained to the calls' JSON without one)",
                            "tool_choice" if choice else "tools")
        try:
            if no_format or (forced and not tool_parser.has_structural_tag):
                check_tools(tools, choice)
                tool_grammar, tool_parser = json_tool_choice(tools, choice, parallel_tool_calls=parallel,
                                                             whitespace=json_whitespace)
            else:
                tool_grammar = tool_choice_grammar(tool_parser, tools, choice if choice is not None else "auto",
                                                   parallel_tool_calls=parallel)
        except RequestError as e:
            raise PlanError(str(e), "tool_choice" if "tool_choice" in str(e) and choice else "tools") from None
        if tool_grammar is not None:
            if plan.grammar is not None:
                raise PlanError("response_format cannot be combined with a tool_choice that forces a call",
                                "response_format")
            plan.grammar = tool_grammar
        plan.tool_parser = tool_parser
    elif choice not in (None, "none", "auto") and not tools:
        raise PlanError("tool_choice needs tools", "tool_choice")
    try:
        budget = thinking_budget(req.reasoning_effort, req.max_thinking_tokens, efforts)
    except RequestError as e:
        raise PlanError(str(e), "max_thinking_tokens" if req.max_thinking_tokens is not None
                        else "reasoning_effort") from None
    if reasoning_parser is None:
        if req.max_thinking_tokens is not None:
            raise PlanError("max_thinking_tokens needs a reasoning model (this one has no thinking block; start "
                            "kiln serve with --reasoning-parser NAME if it does)", "max_thinking_tokens")
        return plan  # reasoning_effort means nothing to a model that does not reason: ignored, as OpenAI does
    phase = reasoning_parser.prompt_phase(prompt)
    plan.reasoning = reasoning_parser
    plan.prompt_in_thinking = phase == "thinking"
    if phase == "answer":  # the template closed the block (thinking disabled): nothing to count or force
        return plan
    plan.thinking = ThinkingConfig.from_tokenizer(tokenizer, reasoning_parser, phase=phase, budget=budget)
    plan.send_thinking = plan.thinking.phase is not ThinkPhase.ANSWER and (
        budget is not None or plan.grammar is not None)
    return plan


# Output ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class ChoiceOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ChoiceParser:
    """One choice's text split into reasoning, content and tool calls: `feed(delta)` / `finish()` give the
    pieces that are certain so far (a stream's deltas), `parse(text)` the whole output at once. The two agree:
    concatenated deltas equal the whole parse (each parser's contract)."""

    def __init__(self, plan: RequestPlan) -> None:
        self.plan = plan
        self._reasoning = plan.reasoning.stream(plan.prompt_in_thinking) if plan.reasoning is not None else None
        self._tools = plan.tool_parser.stream() if plan.tool_parser is not None else None

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and bool(self._tools.tool_calls)

    def feed(self, delta: str, final: bool = False) -> ChoiceOutput:
        reasoning, content = "", delta
        if self._reasoning is not None:
            d = self._reasoning.feed(delta)
            reasoning, content = d.reasoning, d.content
            if final:
                d = self._reasoning.finish()
                reasoning, content = reasoning + d.reasoning, content + d.content
        calls: list[dict] = []
        if self._tools is not None:
            m = self._tools.feed(content)
            content, calls = m.content, [c.to_openai() for c in m.tool_calls]
            if final:
                m = self._tools.finish()
                content += m.content
                calls += [c.to_openai() for c in m.tool_calls]
            if self.plan.single_call:
                calls = [c for c in calls if c["index"] == 0]
        return ChoiceOutput(reasoning or None, content or None, calls)

    def parse(self, text: str) -> ChoiceOutput:
        plan = self.plan
        reasoning, content = None, text
        if plan.reasoning is not None:
            split = plan.reasoning.parse(text, plan.prompt_in_thinking)
            reasoning, content = split.reasoning, split.content or ""
        if plan.tool_parser is None:
            return ChoiceOutput(reasoning, content or None)
        result = plan.tool_parser.parse(content)
        calls = result.tool_calls[:1] if plan.single_call else result.tool_calls
        return ChoiceOutput(reasoning, result.content, [c.to_openai() for c in calls])
