"""`composer <verb>`: generate, models, convert, serve. A ComposerError prints as one line and exits 1; no traceback."""

from __future__ import annotations

import argparse
import sys

from composer.errors import Cancelled, ComposerError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with composer's exit code: a usage error exits 1, as every other bad input does (argparse's
    own is 2). Subcommand parsers are made of the same class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
