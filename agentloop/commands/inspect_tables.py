"""The tables ``agentloop inspect`` prints: the run's rollouts and the app sessions of a store ``agentloop serve`` wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop.commands.inspect_text import printable
from agentloop.proxy.sessions import SessionRecord
from agentloop.types import Rollout


def _trained(rec: SessionRecord) -> str:
    """What an online update did with a session: ``v2 (update 3)``, ``rejected (update 4)``, ``-``."""
    t = rec.trained
    if t is None:
        return "-"
    return f"{f'v{t.version}' if t.outcome == 'promoted' else t.outcome} (update {t.update})"


def session_reward(rec: SessionRecord) -> float | None:
    return rec.total_reward


def print_rollouts(
    w: Callable[[str], Any], rows: list[tuple[Rollout, float | None, int]], db: Path, limit: int
) -> None:
    """The rollout table: the last ``limit`` rows."""
    w(f"{len(rows)} rollouts in {db if db.name != 'store.db' else db.parent}\n")
    w(f"{'rollout':<14} {'mode':<5} {'status':<10} {'attempts':>8} {'calls':>5} {'reward':>7}  input\n")
    for rollout, reward, calls in rows[-limit:]:
        shown = json.dumps(rollout.input)[:60]
        r = "-" if reward is None else f"{reward:.3f}"
        rid = printable(rollout.rollout_id[:13])
        w(
            f"{rid:<14} {rollout.mode:<5} {rollout.status.value:<10} {rollout.num_attempts:>8} {calls:>5} {r:>7}  {shown}\n"
        )


def print_sessions(
    w: Callable[[str], Any],
    server: dict[str, Any],
    sessions: list[SessionRecord],
    session_rewards: dict[str, float | None],
    db: Path,
    limit: int,
) -> None:
    """The app session table (a store ``agentloop serve`` wrote): the last ``limit`` sessions."""
    served = printable(str(server.get("model", "?")))
    trained = sum(rec.trained is not None for rec in sessions)
    w(
        f"{len(sessions)} app sessions in {db} (served model {served}; {trained} trained on by serve --train)\n"
    )
    w(f"{'session':<22} {'calls':>5} {'reward':>7} {'trained':<16} first message\n")
    for rec in sessions[-limit:]:
        reward = session_rewards[rec.session_id]
        r = "-" if reward is None else f"{reward:.3f}"
        head = rec.calls[:1]
        first = json.dumps(head[0].messages[-1].get("content") if head and head[0].messages else "")
        w(
            f"{printable(rec.session_id[:21]):<22} {len(rec.call_json):>5} {r:>7} {_trained(rec):<16} "
            f"{printable(first[:60])}\n"
        )
