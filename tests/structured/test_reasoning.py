"""Reasoning: `<think>…</think>` split into reasoning and content (whole and streamed in any pieces), where a
real template's prompt leaves the output, reasoning_effort → budget, and the token-level tracker: a budget of
N gives at most N reasoning tokens and then an answer, a forced end the model began is continued, rollback."""
from __future__ import annotations

import random

import pytest
from kiln.runtime.api.reasoning_parsers import get_reasoning_parser, reasoning_parser_for
from kiln.runtime.errors import RequestError
from kiln.runtime.thinking import (
    ReasoningTracker,
    ThinkingConfig,
    ThinkPhase,
    count_reasoning_tokens,
    effort_budgets,
    parse_effort_budgets,
    thinking_budget,
)

# (output, prompt opened the block, reasoning, content)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, "Let me see.", "The answer is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Let me see.\n</think>\n\nFour.", True, "Let me see.", "Four."),
    ("No thinking here.", False, None, "No thinking here."),
    ("<think>\ncut off mid thought", False, "cut off mid thought", None),
    ("still thinking\n", True, "still thinking\n", None),
    ("<think>\n\n</think>\n\nHi", False, None, "Hi"),
    ("<think>x</think>", False, "x", None),
    ("<thinking is not the tag", False, None, "<thinking is not the tag"),
    ("a < b </thin and </think> c </think> d", True, "a < b </thin and ", " c </think> d"),  # spaces kept
    ("line\n\nline2\n\n</think>\n\n\ncontent\n\nmore", True, "line\n\nline2", "content\n\nmore"),
    ("", True, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c[0][:20]))
def test_split_whole_and_streamed(case):
    text, in_thinking, reasoning, content = case
    parser = get_reasoning_parser("qwen3")
    result = parser.parse(text, prompt_in_thinking=in_thinking)
    assert (result.reasoning, result.content) == (reasoning, content)
    rng = random.Random(text)
    for _ in range(30):
        stream = parser.stream(in_thinking)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(8)))) if len(text) > 1 else []
        pieces = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [stream.finish()]
        assert "".join(p.reasoning for p in pieces) == (reasoning or "")
        assert "".join(p.content for p in pieces) == (content or "")


def test_family_tags_and_template_detection(family_tokenizer):
    assert get_reasoning_parser("mistral").parse("[THINK]hm[/THINK]ok").reasoning == "hm"
    assert reasoning_parser_for(family_tokenizer("qwen3_thinking_2507").template) == "think"
    assert reasoning_parser_for(family_tokenizer("deepseek_v3").template) == "think"  # it strips </think> from history
    assert reasoning_parser_for(family_tokenizer("llama3_1").template) is None
    with pytest.raises(RequestError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


def test_where_real_prompts_leave_the_output(family_tokenizer):
    parser = get_reasoning_parser("qwen3")
    tok = family_tokenizer("qwen3_thinking_2507")
    prompt = tok.kiln.apply_chat_template([{"role": "user", "content": "hi"}])
    assert parser.prompt_phase(prompt) == "thinking"  # the template ends the prompt with <think>\n
    assert parser.prompt_phase(prompt + "Okay.\n</think>\n\n") == "answer"
    plain = family_tokenizer("qwen2_5").kiln.apply_chat_template([{"role": "user", "content": "hi"}])
    assert parser.prompt_phase(plain) == "maybe"


def test_reasoning_effort_maps_to_a_budget():
    assert thinking_budget() is None
    assert thinking_budget("low") < thinking_budget("medium") < thinking_budget("high")
    assert thinking_budget("high", max_thinking_tokens=7) == 7  # kiln's explicit budget wins
    assert thinking_budget("minimal") == 0
    for bad in ({"reasoning_effort": "extreme"}, {"max_thinking_tokens": -1}, {"max_thinking_tokens": True}):
        with pytest.raises(RequestError):
            thinking_budget(**bad)


def test_effort_tables_override_the_defaults_in_order():
    table = effort_budgets({"low": 64, "deep": 9000}, parse_effort_budgets("low=32, high=4096"))
    assert table == {"none": 0, "minimal": 0, "low": 32, "medium": 2048, "high": 4096, "deep": 9000}
    assert thinking_budget("deep", efforts=table) == 9000 and thinking_budget("low", efforts=table) == 32
    with pytest.raises(RequestError, match="one of none, minimal, low, medium, high, deep"):
        thinking_budget("max", efforts=table)
    for bad in ("low", "low=", "low=-3", "low=1.5", "Low=3", "=3"):
        with pytest.raises(RequestError):
            parse_effort_budgets(bad)
    for entries in ({"low": -1}, {"low": True}, {"low": "8"}, {"hi gh": 8}):
        with pytest.raises(RequestError):
            effort_budgets(entries)


END, NL, START = 900, 10, 899
CFG = ThinkingConfig(start_ids=(START,), end_ids=(END,), force_ids=(NL, END))


def _run(tracker: ReasoningTracker, model_tokens, limit: int = 200) -> list[int]:
    """Feeds the model's tokens except where the tracker forces one: returns what the output became."""
    out = []
    it = iter(model_tokens)
    while tracker.phase is not ThinkPhase.ANSWER and len(out) < limit:
        forced = tracker.forced_token()
        token = forced if forced is not None else next(it)
        tracker.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 5, 17])
def test_budget_bounds_reasoning_tokens_then_the_answer_comes(budget):
    import dataclasses

    tracker = ReasoningTracker(dataclasses.replace(CFG, budget=budget))
    out = _run(tracker, iter(lambda: 5, None))  # a model that would think forever
    assert out[-2:] == [NL, END]  # ended by the forced sequence
    assert tracker.count == len(out) <= max(budget, 2)
    assert tracker.phase is ThinkPhase.ANSWER and tracker.forced_token() is None
    assert count_reasoning_tokens(tracker.config, out + [7, 8]) == tracker.count


def test_a_forced_end_the_model_began_is_continued():
    import dataclasses

    tracker = ReasoningTracker(dataclasses.replace(CFG, budget=6))
    out = _run(tracker, [5, 5, 5, NL, 5, 5, 5])
    assert out == [5, 5, 5, NL, END]  # the model's own "\n" counts as the start of the forced sequence
    assert tracker.count == 5


def test_the_model_may_end_thinking_itself_and_open_it_itself():
    tracker = ReasoningTracker(CFG)
    assert _run(tracker, [5, 6, END]) == [5, 6, END] and tracker.count == 3
    maybe = ThinkingConfig(start_ids=(START,), end_ids=(END,), force_ids=(END,), phase=ThinkPhase.MAYBE, budget=3)
    tracker = ReasoningTracker(maybe)
    assert tracker.may_open == START
    assert not tracker.accept(START) and tracker.in_thinking  # the start tag is reasoning, not answer
    assert _run(tracker, [5, 5, 5, 5]) == [5, END] and tracker.count == 3
    direct = ReasoningTracker(maybe)
    assert direct.accept(42) and direct.phase is ThinkPhase.ANSWER  # answered at once: no thinking block


def test_rollback_restores_the_state():
    import dataclasses

    tracker = ReasoningTracker(dataclasses.replace(CFG, budget=4))
    for t in (5, 5):
        tracker.accept(t)
    snapshot = (tracker.phase, tracker.count, tracker.forced_token())
    for t in (NL, END, 3):
        tracker.accept(t)
    assert tracker.phase is ThinkPhase.ANSWER
    tracker.rollback(3)
    assert (tracker.phase, tracker.count, tracker.forced_token()) == snapshot
    with pytest.raises(AssertionError):
        tracker.rollback(10)


def test_config_from_a_tokenizer(family_tokenizer):
    tok = family_tokenizer("qwen3_thinking_2507").kiln
    cfg = ThinkingConfig.from_tokenizer(tok, get_reasoning_parser("qwen3"), phase="thinking", budget=64)
    end = tok.encode("</think>", add_special_tokens=False)
    assert list(cfg.end_ids) == end and len(end) == 1  # an added token
    assert cfg.force_ids[-1] == end[0] and tok.decode(list(cfg.force_ids)) == "\n</think>"
