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
    _add_demo_command(sub)
    return parser


def _add_demo_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`agentloop demo [--task arithmetic|tools] [OPTIONS]`: GRPO on an agent with SmolLM2 on CPU.

    The options belong to trainer.demo (``--task tools``: trainer.demo_tools), imported only when the
    command runs (it pulls in torch).
    """

    def run(args: argparse.Namespace) -> int:
        from trainer.demo import build_parser as demo_parser
        from trainer.demo import main as demo_main

        return demo_main(demo_parser().parse_args(args.demo_args))

    demo = sub.add_parser(  # prefix_chars no option uses: every word goes to demo_args untouched
        "demo",
        add_help=False,
        prefix_chars="\x00",
        help="train SmolLM2 with GRPO on this CPU: arithmetic, or --task tools (a ToolAgent with a "
        "calculator); demo --help, demo --task tools --help: their options",
    )
    demo.add_argument("demo_args", nargs="*")
    demo.set_defaults(func=run)


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
