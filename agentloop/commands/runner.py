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
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("runner", help="run an agent's rollouts against a remote store (HTTP)")
    p.add_argument("--store", required=True, help="store URL, e.g. http://10.0.0.5:8765")
    p.add_argument("--agent", required=True, help="module:object of an @al.rollout function or al.Agent")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts run at once (default 8)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("AGENTLOOP_STORE_API_KEY"),
        help="bearer token of the store (default: $AGENTLOOP_STORE_API_KEY)",
    )
    p.add_argument("--max-rollouts", type=int, default=None, help="exit after this many attempts")
    p.add_argument("--worker-id", default=None, help="name in the store (default: runner-<random>)")
    p.set_defaults(func=run)


def load_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; raises ValueError saying what was expected."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--agent must look like module:object (e.g. examples.calc_x.agent:agent), got {spec!r}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: agents in the working folder are found
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--agent {spec!r}: cannot import module {module_name!r} ({exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"--agent {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def run(args: argparse.Namespace) -> int:
    from agentloop.runner import Runner
    from agentloop.store.http import StoreClient

    if args.concurrency < 1:
        sys.stderr.write(f"agentloop runner: --concurrency must be >= 1, got {args.concurrency}\n")
        return 2
    if args.max_rollouts is not None and args.max_rollouts < 0:
        sys.stderr.write(f"agentloop runner: --max-rollouts must be >= 0, got {args.max_rollouts}\n")
        return 2
    try:
        agent = load_object(args.agent)
        store = StoreClient(args.store, api_key=args.api_key, max_connections=max(16, 4 * args.concurrency))
        runner = Runner(agent, store, concurrency=args.concurrency, worker_id=args.worker_id)
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"agentloop runner: {exc}\n")
        return 2
    stats = runner.run_sync(max_rollouts=args.max_rollouts)
    sys.stdout.write(f"agentloop runner {runner.worker_id}: {vars(stats)}\n")
    return 0
