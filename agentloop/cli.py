"""The ``agentloop`` command.

Every subcommand gets three things from :func:`main`:

- **Errors in one line.** A :class:`UsageError` (a bad argument, job file, path or import) prints
  ``agentloop CMD: error: <what is wrong and how to fix it>`` and exits 2; any other exception
  prints one line and exits 1. ``--debug`` shows the traceback instead.
- **A quiet console.** Logs go to stderr as human lines (``--log-format json``: JSON lines), on a
  terminal and when piped; events about one rollout (``attempt_started`` and the like) print only
  with ``-v``; libraries' download and loading progress bars are off (on with ``-v``); tracebacks in
  logs never carry local variables. A training run keeps the rest in its ``log.txt``.
- **Clean stops.** Ctrl-C or SIGTERM lets the command clean up without logging, prints
  ``agentloop CMD: stopped by SIGINT`` and exits 130 (SIGTERM: 143); a second signal exits at once.

``--debug``, ``-v`` and ``--log-format`` are accepted before or after the command name;
``agentloop --version`` (or ``agentloop version``) prints ``agentloop <version>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from agentloop._version import __version__
from agentloop.errors import AgentLoopError, UsageError  # also agentloop.cli.UsageError, as before

Command = Callable[[argparse.Namespace], int]


def _version(_: argparse.Namespace) -> int:
    sys.stdout.write(f"agentloop {__version__}\n")
    return 0


def _add_global_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    """--debug, -v and --log-format; on a subcommand their default is SUPPRESS, so they never undo the
    top-level ones (the top level's: False, False, None)."""
    parser.add_argument(
        "--debug", action="store_true", default=default, help="on an error, show the full traceback"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="log everything, per-rollout events and debug lines included",
    )
    parser.add_argument(
        "--log-format",
        choices=("human", "json"),
        default=default,
        help="log lines for people (default) or JSON lines for machines",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentloop",
        description="Train the model behind your agents with RL, keeping the exact tokens it produced.",
        epilog="COMMAND --help shows a command's options; --debug and -v also work after the command.",
    )
    parser.add_argument("--version", action="version", version=f"agentloop {__version__}")
    _add_global_flags(parser, default=False)
    parser.set_defaults(log_format=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the installed version")
    version.set_defaults(func=_version)
    from agentloop.commands import register

    register(sub)
    for command in sub.choices.values():
        _add_global_flags(command, default=argparse.SUPPRESS)
    _add_demo_command(sub)  # after the loop: demo hands every word to trainer.demos.arithmetic's own parser
    return parser


def _add_demo_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`agentloop demo [--task arithmetic|tools] [OPTIONS]`: GRPO on an agent with SmolLM2 on CPU.

    The options belong to trainer.demos.arithmetic (``--task tools``: trainer.demos.tools), imported only when the
    command runs (it pulls in torch).
    """

    def run(args: argparse.Namespace) -> int:
        from trainer.demos.arithmetic import build_parser as demo_parser
        from trainer.demos.arithmetic import main as demo_main

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


# ---------------------------------------------------------------- signals


class _Stop:
    """Turns the first SIGINT/SIGTERM into a KeyboardInterrupt (so ``finally`` blocks and async
    cleanup run) with logging silenced; the second one ends the process at once."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.signum: int | None = None

    def __call__(self, signum: int, _: FrameType | None) -> None:
        if self.signum is not None:
            sys.stderr.write(f"{self.prog}: stopped by {signal.Signals(signum).name}, without cleaning up\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        _silence()
        from agentloop import event_loop

        if event_loop.request_stop():  # a loop runs the command: it is cancelled there, then stops
            return
        raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _silence() -> None:
    """No more log lines or shutdown chatter: the command is stopping on purpose."""
    from agentloop.logging import silence

    silence()
    logging.disable(logging.CRITICAL)  # the standard library's loggers (asyncio, Ray)
    sys.unraisablehook = lambda _: None  # "Task was destroyed but it is pending!" and the like


def _stop_signal(exc: BaseException, stop: _Stop) -> int | None:
    """The signal that ``exc`` stands for, or None when it is an ordinary error."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            signum = _stop_signal(inner, stop)
            if signum is not None:
                return signum
        return None
    if isinstance(exc, KeyboardInterrupt):
        return stop.signum or signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:  # Ray's SIGTERM handler: sys.exit(15)
        return signal.SIGTERM
    return None


# ---------------------------------------------------------------- errors


def _leaf(exc: BaseException) -> BaseException:
    """The error worth naming: the one inside a task group of one, or a Ray task's cause."""
    while True:
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        elif isinstance(getattr(exc, "cause", None), BaseException):  # ray.exceptions.RayTaskError
            exc = exc.cause  # type: ignore[attr-defined]
        else:
            return exc


def describe(exc: BaseException) -> str:
    """One line for an error: agentloop's own messages as they are (they say the fix); anything
    else with its type and where to get the traceback."""
    exc = _leaf(exc)
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    message = str(exc).strip()
    if isinstance(exc, UsageError | AgentLoopError):
        return message or type(exc).__name__
    first = message.splitlines()[0] if message else ""
    return f"{type(exc).__name__}: {first} (run again with --debug for the traceback)"


def _configure_logging(verbose: bool, log_format: str | None) -> None:
    from agentloop.logging import configure_logging

    if not verbose:  # transformers' and the hub's "Loading weights" bars: one progress bar is enough
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    as_json = None if log_format is None else log_format == "json"
    if verbose:
        configure_logging("DEBUG", json=as_json)
    else:
        configure_logging(json=as_json, rollout_level="WARNING")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    prog = f"agentloop {args.command}"
    _configure_logging(args.verbose, args.log_format)
    stop = _Stop(prog)
    with stop.installed():
        try:
            return func(args)
        except BaseException as exc:
            signum = _stop_signal(exc, stop)
            if signum is not None:
                if args.debug:
                    raise
                _silence()
                sys.stderr.write(f"{prog}: stopped by {signal.Signals(signum).name}\n")
                return 128 + signum
            if isinstance(exc, SystemExit) or args.debug:
                raise
            sys.stderr.write(f"{prog}: error: {describe(exc)}\n")
            return 2 if isinstance(_leaf(exc), UsageError) else 1


if (
    __name__ == "__main__"
):  # `python -m agentloop.cli`: run the imported module, whose UsageError the commands raise
    from agentloop.cli import main as _main

    sys.exit(_main())
