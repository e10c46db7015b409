"""`--help` of every subcommand says what each option means and what it defaults to (issue 10 item 20)."""
from __future__ import annotations

import argparse

import pytest

from kiln.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every leaf subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _commands(child, (*path, name))


COMMANDS = dict(_commands(build_parser()))


def test_every_subcommand_is_covered():
    assert {" ".join(p) for p in COMMANDS} >= {"compile", "recipe from-hf", "generate", "serve", "eval ppl",
                                                "eval compare", "bench serve", "bench sweep", "bench engine"}


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_each_option_states_its_meaning_and_default(path):
    parser = COMMANDS[path]
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = (action.help or "").lower()
        if len(text) < 12:
            missing.append(f"{name}: no help")
        elif action.option_strings and action.nargs != 0 and not action.required and "default" not in text:
            missing.append(f"{name}: no default in {action.help!r}")
    assert not missing, f"kiln {' '.join(path)} --help: " + "; ".join(missing)
    text = parser.format_help()
    assert "usage: kiln " + " ".join(path) in text
