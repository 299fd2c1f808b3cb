"""``agentloop rollback --to N``: serve an earlier promoted weights version of ``agentloop serve --train``.

Talks to the running server's admin API (``POST /v1/admin/rollback``); ``--list`` prints the promoted
versions, their scores and the promotion log as a table (``GET /v1/admin/versions``; ``--json`` for the
raw answer). ``--url`` is the server's address, or the base URL its banner prints (``.../v1``). Both need the server's
admin key (an app key is not enough), from ``--admin-key-file``, ``--admin-key env:NAME|file:PATH`` or
``$AGENTLOOP_ADMIN_KEY`` as for ``serve``; a server started without one has its admin routes off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agentloop.errors import UsageError

KEY_ENV = "AGENTLOOP_ADMIN_KEY"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("rollback", help="serve an earlier promoted version (agentloop serve --train)")
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server's address or its banner's base URL (.../v1)",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", type=int, metavar="N", help="the promoted version to serve")
    what.add_argument("--list", action="store_true", help="print the promoted versions and the log")
    p.add_argument(
        "--admin-key-file", type=Path, default=None, help=f"the server's admin key (or ${KEY_ENV})"
    )
    p.add_argument("--admin-key", default=None, help="the admin key as env:NAME or file:PATH")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer as it came")
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
    base = server_address(args.url)
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
    answer = r.json()
    if args.json:
        sys.stdout.write(json.dumps(answer, indent=2) + "\n")
    elif args.list:
        sys.stdout.write(versions_table(answer))
    else:
        sys.stdout.write(f"serving version {answer.get('current')} (was {answer.get('from')})\n")
    return 0


def server_address(url: str) -> str:
    """The server's address from ``url``: itself, or the banner's base URL without its ``/v1``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--url must be an http(s) address such as http://127.0.0.1:8000, got {url!r}")
    return base.removesuffix("/v1")


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "-"


def _score(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else "-"


def versions_table(answer: dict[str, Any]) -> str:
    """``GET /v1/admin/versions`` for people: the versions (the serving one starred), counts, the log."""
    current = answer.get("current")
    lines = [
        f"serving version {current}; {answer.get('updates', 0)} updates ({answer.get('updates_failed', 0)} "
        f"failed), {answer.get('sessions_trained', 0)} sessions trained on, "
        f"{answer.get('sessions_dropped_untrained', 0)} dropped untrained",
        f"  {'version':>7}  {'score':>6}  {'update':>6}  promoted at",
    ]
    for v in answer.get("versions", []):
        star = "*" if v.get("version") == current else " "
        step = v.get("step", "-") if v.get("version") else "-"
        lines.append(
            f"{star} {v.get('version', '?'):>7}  {_score(v.get('score')):>6}  {step:>6}  {_when(v.get('time'))}"
        )
    if answer.get("history"):
        lines.append("log:")
    for h in answer.get("history", []):
        kind = str(h.get("kind", "?"))
        what = {
            "baseline": f"version {h.get('version')} scored {_score(h.get('score'))}",
            "promoted": f"update {h.get('step')} became version {h.get('version')}: score {_score(h.get('score'))}"
            f" (best so far {_score(h.get('baseline'))}, margin {h.get('margin')})",
            "refused": f"update {h.get('step')} refused: score {_score(h.get('score'))} below best "
            f"{_score(h.get('baseline'))} - margin {h.get('margin')}; version {h.get('serving')} kept",
            "rollback": f"to version {h.get('version')} from {h.get('from')}",
        }.get(kind, json.dumps({k: v for k, v in h.items() if k not in ("kind", "time")}))
        lines.append(f"  {_when(h.get('time'))}  {kind:<9} {what}")
    return "\n".join(lines) + "\n"
