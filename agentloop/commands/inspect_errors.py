"""``agentloop inspect RUN --errors``: the run's failed attempts and where the agent raised.

The runner stores each failed attempt's traceback in the store (``ErrorInfo``); this prints, read-only:

- a table of the failed (and timed-out) attempts: rollout, try number, status, error, the line of the
  user's code it came from (``agent.py:6 in score``);
- for each distinct error (type and first line of the message), the first attempt's traceback with
  agentloop's and other libraries' frames folded (agentloop.agent_errors), and how many attempts had it.

``--rollout ID`` narrows it to one rollout and prints every traceback of its attempts in full. Error
messages may quote model output or tasks: every string is printed escaped (``printable``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from agentloop.agent_errors import fold_traceback, user_location
from agentloop.types import Attempt, AttemptStatus

_FAILED = (AttemptStatus.FAILED, AttemptStatus.TIMEOUT)


def failed_attempts(conn: sqlite3.Connection) -> tuple[list[Attempt], int]:
    """The attempts that failed or timed out, in the order they were made, and the number of attempts."""
    attempts = [
        Attempt.model_validate_json(r[0]) for r in conn.execute("SELECT data FROM attempts ORDER BY rowid")
    ]
    return [a for a in attempts if a.status in _FAILED], len(attempts)


def _kind(attempt: Attempt) -> str:
    error = attempt.error
    if error is None:
        return attempt.status.value
    first = error.message.strip().splitlines()[0] if error.message.strip() else ""
    return f"{error.type}: {first}" if first else error.type


def print_errors(
    conn: sqlite3.Connection,
    where: Path,
    write: Callable[[str], object],
    printable: Callable[[str], str],
    *,
    rollout: str | None = None,
    limit: int = 20,
) -> int:
    """Write the failed attempts of the store on ``conn`` (see the module docstring); returns the exit code."""
    failed, total = failed_attempts(conn)
    if rollout is not None:
        failed = [a for a in failed if a.rollout_id.startswith(rollout)]
    if not failed:
        of = f" of rollout {printable(rollout)!r}" if rollout is not None else ""
        write(f"no failed attempt{of} in {where} ({total} attempt{'s' if total != 1 else ''})\n")
        return 0
    kinds: dict[str, list[Attempt]] = {}
    for attempt in failed:
        kinds.setdefault(_kind(attempt), []).append(attempt)
    n, k = len(failed), len(kinds)
    write(
        f"{n} failed attempt{'s' if n != 1 else ''} of {total} in {where}, "
        f"{k} kind{'s' if k != 1 else ''} of error\n"
    )
    write(f"{'rollout':<14} {'try':>3} {'status':<8} {'where':<32} error\n")
    for attempt in failed[-limit:]:
        error = attempt.error
        at = (user_location(error.traceback) if error is not None else None) or "-"
        write(
            f"{printable(attempt.rollout_id[:13]):<14} {attempt.sequence_id:>3} {attempt.status.value:<8} "
            f"{printable(at)[:32]:<32} {printable(_kind(attempt))[:100]}\n"
        )
    if len(failed) > limit:
        write(f"(the last {limit}; --limit N shows more)\n")
    for kind, attempts in kinds.items():
        first = attempts[0]
        count = f"{len(attempts)} attempt{'s' if len(attempts) != 1 else ''}"
        if rollout is not None:  # one rollout: every attempt's traceback, unfolded
            for attempt in attempts:
                write(
                    f"\n{printable(kind)} (rollout {printable(attempt.rollout_id)}, try {attempt.sequence_id})\n"
                )
                text = attempt.error.traceback if attempt.error is not None else None
                write(printable(text or "(no traceback recorded)").rstrip("\n") + "\n")
            continue
        write(
            f"\n{printable(kind)}: {count}; the first (rollout {printable(first.rollout_id)}, "
            f"try {first.sequence_id}):\n"
        )
        text = first.error.traceback if first.error is not None else None
        body = fold_traceback(text) if text else "(no traceback recorded)"
        write(printable(body).rstrip("\n") + "\n")
    if rollout is None:
        write("\n--errors --rollout ID prints a rollout's tracebacks in full\n")
    return 0
