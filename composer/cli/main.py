"""`composer <verb>`: generate, models, convert, serve. A ComposerError prints as one line and exits 1; no traceback."""

from __future__ import annotations

import argparse
import sys

from composer.errors import Cancelled, ComposerError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with composer's exit code and one-line errors: a usage error exits 1, as every other bad input does
    (argparse's own is 2), and prints one line pointing at --help instead of a usage of every flag first.
    Subcommand parsers are made of the same class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        import difflib
        import re

        # argparse's "invalid choice: 'generat' (choose from 'generate', ...)": the nearest choice first
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            near = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), n=1)
            message += f"; did you mean {near[0]}?" if near else ""
        self.exit(1, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def unknown_arguments_message(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """What `extra` (arguments no flag took) is, in one sentence: an unknown flag with the nearest known one
    ("--promt": did you mean --prompt?), or a value no flag takes."""
    import difflib

    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    flags = [a for a in extra if a.startswith("-") and len(a) > 1 and not a[1:2].isdigit()]
    if not flags:
        return f"unexpected argument {extra[0]!r}: every value follows its flag (e.g. --prompt \"a cat\")"
    name = flags[0].split("=", 1)[0]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else ""
    more = f" (and {', '.join(flags[1:])})" if len(flags) > 1 else ""
    return f"unknown flag {name}{more}{hint}"


def build_parser() -> argparse.ArgumentParser:
    from composer import __version__
    from composer.cli import convert, generate, models, serve

    parser = ArgumentParser(
        prog="composer", description="Inference engine for video diffusion models.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"composer {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="{generate,models,convert,serve}")
    generate.add_parser(sub)
    models.add_parser(sub)
    convert.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the verb's parser, whose flags the suggestion is drawn from
        verb = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.verb]
        verb.error(unknown_arguments_message(verb, extra))
    try:
        return int(args.run(args) or 0)
    except Cancelled as exc:  # Ctrl-C during generation (cli/interrupt.py): the shell's 128 + SIGINT
        print(f"composer: {exc}", file=sys.stderr)
        return 130
    except ComposerError as exc:
        print(f"composer: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("composer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `composer models | head`: the reader left; stop quietly, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # the shell's 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
