"""The `lazarus` command line. Each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import sys

from . import plan_command, run_command, simulate_command


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lazarus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan_command.register(sub)
    run_command.register(sub)
    simulate_command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args) or 0
    except (UsageError, ValueError) as e:
        print(f"lazarus: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
