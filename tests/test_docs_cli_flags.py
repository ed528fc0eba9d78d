"""Every `composer VERB ... --flag` the docs and the README show is a flag that verb's parser takes (docs/memory.md
once wrote `--model` for `--model-path`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from composer.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"\bcomposer ((?:[a-z][a-z0-9-]* ?)+)([^`|#\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _command_parser(words: list[str]) -> argparse.ArgumentParser | None:
    """The parser of `composer WORDS...` (nested verbs such as `convert quantize` followed), None when the first
    word is not a verb (prose that says "composer" without a command)."""
    parser, found = build_parser(), False
    for word in words:
        sub = _subcommands(parser).get(word)
        if sub is None:
            break
        parser, found = sub, True
    return parser if found else None


def _doc_commands():
    for path in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuation lines joined
        for match in COMMAND.finditer(text):
            yield path.name, match.group(0), match.group(1).split(), match.group(2)


def test_every_flag_the_docs_show_is_one_the_cli_takes():
    wrong, seen = [], 0
    for name, command, words, rest in _doc_commands():
        parser = _command_parser(words)
        if parser is None:
            continue
        seen += 1
        for flag in FLAG.findall(" ".join(words) + " " + rest):
            if flag not in parser._option_string_actions:
                wrong.append(f"{name}: {flag} in `{command.strip()[:90]}`")
    assert seen > 20  # the scan finds the commands
    assert not wrong, "\n".join(wrong)
