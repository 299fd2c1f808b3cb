"""``agentloop rollback --to N``: serve an earlier promoted weights version of ``agentloop serve --train``.

Talks to the running server's admin API (``POST /v1/admin/rollback``); ``--list`` prints the promoted
versions, their scores and the promotion log (``GET /v1/admin/versions``). Both need the server's
admin key (an app key is not enough), from ``--admin-key-file``, ``--admin-key env:NAME|file:PATH`` or
``$AGENTLOOP_ADMIN_KEY`` as for ``serve``; a server started without one has its admin routes off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from agentloop.cli import UsageError

KEY_ENV = "AGENTLOOP_ADMIN_KEY"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("rollback", help="serve an earlier promoted version (agentloop serve --train)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's address (serve's banner)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", type=int, metavar="N", help="the promoted version to serve")
    what.add_argument("--list", action="store_true", help="print the promoted versions and the log")
    p.add_argument(
        "--admin-key-file", type=Path, default=None, help=f"the server's admin key (or ${KEY_ENV})"
    )
    p.add_argument("--admin-key", default=None, help="the admin key as env:NAME or file:PATH")
    p.set_defaults(func=run)


def _key(args: argparse.Namespace) -> str | None:
    from agentloop.keys import read_key

    if args.admin_key_file is not None and args.admin_key:
        raise UsageError("give --admin-key-file or --admin-key, not both")
    try:
        if args.admin_key_file is not None:
            key = read_key(f"file:{args.admin_key_file}", "--admin-key-file")
        elif args.admin_key:
            key = read_key(args.admin_key, "--admin-key")
        elif os.environ.get(KEY_ENV):
            key = read_key(f"env:{KEY_ENV}", KEY_ENV)
        else:
            return None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return key.get_secret_value() if key is not None else None


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.to is not None and args.to < 0:
        raise UsageError(f"--to must be a version >= 0, got {args.to}")
    key = _key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.url.rstrip("/")
    try:
        if args.list:
            r = httpx.get(f"{base}/v1/admin/versions", headers=headers, timeout=30)
        else:
            r = httpx.post(
                f"{base}/v1/admin/rollback", json={"version": args.to}, headers=headers, timeout=600
            )
    except httpx.HTTPError as exc:
        raise UsageError(
            f"cannot reach {base} ({exc}); is `agentloop serve --train` running there?"
        ) from None
    if r.status_code == 404 and "not_found" not in r.text:
        raise UsageError(f"{base} has no admin API: it is not running `agentloop serve --train`")
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise UsageError(f"{base} answered {r.status_code}: {message}")
    sys.stdout.write(json.dumps(r.json(), indent=2) + "\n")
    return 0
