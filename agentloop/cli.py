"""The ``agentloop`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import agentloop

Command = Callable[[argparse.Namespace], int]


def _version(_: argparse.Namespace) -> int:
    sys.stdout.write(f"agentloop {agentloop.__version__}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentloop",
        description="Train the model behind your agents with RL, keeping the exact tokens it produced.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the installed version")
    version.set_defaults(func=_version)
    from agentloop.commands import register

    register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
