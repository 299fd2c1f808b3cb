"""``agentloop runner --store URL --agent module:obj``: run agents against a remote store over HTTP.

A runner on another process or machine pulls rollouts from the trainer's store (served by
``StoreServer``; the trainer prints its URL when ``trainer.store_server`` is on) and reaches the
model through the proxy URL the store's resources carry. If this process dies, its attempts stop
heart-beating and the store's watchdog requeues them after ``unresponsive_s``: no rollout is lost.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from agentloop import event_loop
from agentloop.errors import ImportObjectError, UsageError
from agentloop.importing import import_object


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("runner", help="run an agent's rollouts against a remote store (HTTP)")
    p.add_argument("--store", required=True, help="store URL, e.g. http://10.0.0.5:8765")
    p.add_argument(
        "--agent",
        required=True,
        help="package.module:name or file.py:name of an @al.rollout function or al.Agent",
    )
    p.add_argument("--concurrency", type=int, default=8, help="rollouts run at once (default 8)")
    p.add_argument(
        "--api-key",
        default="env:AGENTLOOP_STORE_API_KEY" if os.environ.get("AGENTLOOP_STORE_API_KEY") else None,
        help="the store's key: env:NAME or file:PATH (a literal key shows in ps); "
        "default: env:AGENTLOOP_STORE_API_KEY when that is set",
    )
    p.add_argument("--max-rollouts", type=int, default=None, help="exit after this many attempts")
    p.add_argument("--worker-id", default=None, help="name in the store (default: runner-<random>)")
    p.set_defaults(func=run)
    k = sub.add_parser(
        "runner-key",
        help="print the store key of one remote runner (derived from the admin key; give each runner its own)",
    )
    k.add_argument("name", help="the runner's name: 1-64 letters, digits, '_' or '-'")
    k.add_argument(
        "--api-key",
        default="env:AGENTLOOP_STORE_API_KEY",
        help="the store's admin key: env:NAME or file:PATH (default: env:AGENTLOOP_STORE_API_KEY)",
    )
    k.set_defaults(func=print_runner_key)


def print_runner_key(args: argparse.Namespace) -> int:
    """``agentloop runner-key NAME``: the key that lets runner NAME dequeue and report only its own
    attempts (it cannot enqueue, cancel or replace resources), for ``agentloop runner --api-key file:``."""
    from agentloop.keys import read_key
    from agentloop.store._keys import runner_key

    try:
        admin = read_key(args.api_key, "--api-key")
        if admin is None:
            raise UsageError("--api-key names an empty key")
        sys.stdout.write(runner_key(admin, args.name) + "\n")
    except ValueError as exc:  # InvalidRequestError and read_key's errors are ValueErrors
        raise UsageError(str(exc)) from None
    return 0


def load_object(spec: str, what: str = "--agent", *, base: Path | None = None) -> Any:
    """The object an import path names (``agentloop.importing.import_object``, modules also looked up
    in the working folder as ``python -m`` does); any failure is a UsageError with the same message."""
    try:
        return import_object(spec, what, base=base, search_cwd=True)
    except ImportObjectError as exc:
        raise UsageError(str(exc)) from exc.__cause__


def run(args: argparse.Namespace) -> int:
    from agentloop.keys import read_key
    from agentloop.runner import Runner
    from agentloop.store.client import StoreClient

    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.max_rollouts is not None and args.max_rollouts < 0:
        raise UsageError(f"--max-rollouts must be >= 0, got {args.max_rollouts}")
    agent = load_object(args.agent)
    try:
        key = read_key(args.api_key, "--api-key")
        secret = None if key is None else key.get_secret_value()
        store = StoreClient(args.store, api_key=secret, max_connections=max(16, 4 * args.concurrency))
        runner = Runner(agent, store, concurrency=args.concurrency, worker_id=args.worker_id)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    # Runner.run_sync's loop, on uvloop where installed (agentloop.event_loop)
    handle = threading.current_thread() is threading.main_thread()
    stats = event_loop.run(
        functools.partial(runner.run, max_rollouts=args.max_rollouts, handle_signals=handle)
    )
    sys.stdout.write(f"agentloop runner {runner.worker_id}: {vars(stats)}\n")
    if runner.stop_signal is not None:  # stopped by Ctrl-C / SIGTERM: one line, the shell's exit code
        name = signal.Signals(runner.stop_signal).name
        sys.stderr.write(
            f"agentloop runner: stopped by {name} (its unfinished attempts were reported as stopped)\n"
        )
        return 128 + runner.stop_signal
    return 0
