"""``agentloop runner --store URL --agent module:obj``: run agents against a remote store over HTTP.

A runner on another process or machine pulls rollouts from the trainer's store (served by
``StoreServer``; the trainer prints its URL when ``trainer.store_server`` is on) and reaches the
model through the proxy URL the store's resources carry. If this process dies, its attempts stop
heart-beating and the store's watchdog requeues them after ``unresponsive_s``: no rollout is lost.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from agentloop.cli import UsageError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("runner", help="run an agent's rollouts against a remote store (HTTP)")
    p.add_argument("--store", required=True, help="store URL, e.g. http://10.0.0.5:8765")
    p.add_argument("--agent", required=True, help="module:object of an @al.rollout function or al.Agent")
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


def load_object(spec: str, what: str = "--agent", *, base: Path | None = None, dotted: bool = False) -> Any:
    """``package.module:attr.sub`` or ``path/to/file.py:attr`` -> the object.

    A module is looked up in ``base`` (a job file's folder), then the working folder (as
    ``python -m`` does); a ``.py`` file is imported from its own folder, so its sibling modules
    import too (a relative file path is relative to ``base``, else the working folder). ``dotted``: also accept
    ``package.module.attr`` without a colon. Every failure is a UsageError that names what failed
    and where: a missing module, an error raised while importing it (type, message, file and
    line), or a missing attribute.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep and dotted:
        module_name, sep, attr = spec.rpartition(".")
    if not sep or not module_name or not attr:
        example = "examples.calc_x.agent:agent or agent.py:agent"
        raise UsageError(f"{what} must look like module:object (e.g. {example}), got {spec!r}")
    if module_name.endswith(".py"):
        module = _import_file((base or Path.cwd()) / module_name, spec, what)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: agents in the working folder are found
        if base is not None and str(base) not in sys.path:
            sys.path.insert(0, str(base))
        module = _import_module(module_name, spec, what, base)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _import_file(path: Path, spec: str, what: str) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"{what} {spec!r}: file {str(path)!r} does not exist")
    folder, name = str(path.resolve().parent), path.stem
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = _import_module(name, spec, what, None)
    found = Path(getattr(module, "__file__", "") or "")
    if found.resolve() != path.resolve():
        raise UsageError(
            f"{what} {spec!r}: a module named {name!r} is already imported from {str(found)!r}; "
            f"rename {path.name}"
        )
    return module


def _import_module(name: str, spec: str, what: str, base: Path | None) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            where = f"the job file's folder ({base}), " if base is not None else ""
            raise UsageError(
                f"{what} {spec!r}: no module named {exc.name!r} in {where}the working folder ({os.getcwd()}) "
                "or on the Python path"
            ) from None
        raise UsageError(f"{what} {spec!r}: importing {name!r} failed: {_raised_at(exc)}") from exc
    except Exception as exc:  # the module's own code failed: say what and where
        raise UsageError(f"{what} {spec!r}: importing {name!r} failed: {_raised_at(exc)}") from exc


def _raised_at(exc: BaseException) -> str:
    """``Type: message (file.py, line N)``: the innermost frame outside Python's import machinery."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    return f"{text} ({frames[-1].filename}, line {frames[-1].lineno})" if frames else text


def run(args: argparse.Namespace) -> int:
    from agentloop.keys import read_key
    from agentloop.runner import Runner
    from agentloop.store.http import StoreClient

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
    stats = runner.run_sync(max_rollouts=args.max_rollouts)
    sys.stdout.write(f"agentloop runner {runner.worker_id}: {vars(stats)}\n")
    if runner.stop_signal is not None:  # stopped by Ctrl-C / SIGTERM: one line, the shell's exit code
        name = signal.Signals(runner.stop_signal).name
        sys.stderr.write(
            f"agentloop runner: stopped by {name} (its unfinished attempts were reported as stopped)\n"
        )
        return 128 + runner.stop_signal
    return 0
