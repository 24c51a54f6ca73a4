"""The `lazarus` command line. Each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import importlib
import sys

from lazarus_core.malloc import keep_plan_heap

# Each command is the module lazarus_cli.<name>_command, with register(subparsers).
COMMANDS = ("plan", "run", "simulate")


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``only`` that one: a command imports what it
    runs on (the simulator, the local runtime), and `lazarus plan` at 4,096 GPUs spent a
    tenth of its second importing the other two."""
    parser = _Parser(prog="lazarus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        if only in (None, name):
            importlib.import_module(f"{__package__}.{name}_command").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keep_plan_heap()
    # The command comes first (there are no global options but --help).
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
        return args.func(args) or 0
    except (UsageError, ValueError) as e:
        print(f"lazarus: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
