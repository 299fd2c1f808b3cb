"""What ``agentloop inspect`` reads: the store a path names, opened read-only, and a rollout's calls with their advantages."""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

from agentloop.commands.inspect_text import printable
from agentloop.types import Reward, Rollout, Span, Triplet


class InspectError(Exception):
    """A path or id that ``inspect`` cannot use; the message says what to give instead."""


def locate(path: Path) -> Path:
    """The SQLite store that ``path`` names: the file itself, or the one store in the folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise InspectError(f"{path} does not exist; give a run folder or the store `agentloop serve` wrote")
    if (path / "store.db").is_file():
        return path / "store.db"
    dbs = sorted(path.glob("*.db"))
    if len(dbs) > 1:
        names = ", ".join(d.name for d in dbs)
        raise InspectError(f"{path} holds several stores ({names}); give one of them")
    if dbs:
        return dbs[0]
    raise InspectError(
        f"{path} has no store.db; give a run folder written by training, or the store file "
        "`agentloop serve` wrote (agentloop-serve.db by default, in the folder it ran in)"
    )


def _reward(spans: list[Any]) -> float | None:
    values = [s.payload.value for s in spans if isinstance(s.payload, Reward)]
    return sum(values) if values else None


class ReadOnlyStore:
    """The reads ``inspect`` makes, on a read-only connection to the file ``SQLiteStore`` writes
    (``mode=ro``: opening a ``SQLiteStore`` sets the journal mode and creates its tables, both writes).
    Reads the tables ``agentloop/store/sqlite.py`` defines: rollouts (with their latest attempt) and spans.
    """

    def __init__(self, path: Path) -> None:
        uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
        try:
            try:
                self._conn = self._open(uri)
            except sqlite3.OperationalError:  # a WAL store on read-only media: no -shm can be made there
                self._conn = self._open(uri + "&immutable=1")
        except sqlite3.Error as exc:
            raise InspectError(f"{path} cannot be read as an agentloop store: {exc}") from None

    @staticmethod
    def _open(uri: str) -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True)
        try:
            conn.execute("SELECT 1 FROM rollouts LIMIT 1")
        except sqlite3.Error:
            conn.close()
            raise
        return conn

    async def list_rollouts(self) -> list[Rollout]:
        rows = self._conn.execute("SELECT data FROM rollouts ORDER BY seq")
        return [Rollout.model_validate_json(r[0]) for r in rows]

    async def get_rollout(self, rollout_id: str) -> Rollout:
        row = self._conn.execute("SELECT data FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise InspectError(f"no rollout {printable(rollout_id)!r} in the store")
        return Rollout.model_validate_json(row[0])

    async def query_spans(self, rollout_id: str, attempt_id: str = "latest") -> list[Span]:
        """The spans of the rollout's latest attempt (``attempt_id`` other than "latest": that one)."""
        if attempt_id == "latest":
            row = self._conn.execute(
                "SELECT latest_attempt_id FROM rollouts WHERE rollout_id=?", (rollout_id,)
            ).fetchone()
            if row is None or row[0] is None:
                return []
            attempt_id = row[0]
        rows = self._conn.execute(
            "SELECT data FROM spans WHERE attempt_id=? ORDER BY sequence_id", (attempt_id,)
        )
        return [Span.model_validate_json(r[0]) for r in rows]

    async def close(self) -> None:
        self._conn.close()


async def collect(db: Path) -> list[tuple[Rollout, float | None, int]]:
    store = ReadOnlyStore(db)
    try:
        rows = []
        for rollout in await store.list_rollouts():
            spans = await store.query_spans(rollout.rollout_id) if rollout.num_attempts else []
            calls = sum(1 for s in spans if s.kind == "llm_call")
            rows.append((rollout, _reward(spans), calls))
        return rows
    finally:
        await store.close()


async def trajectory(
    run_dir: Path, rollout_id: str, db: Path | None = None
) -> tuple[list[Triplet], Rollout, list[float | None]]:
    """The rollout's calls (one triplet each, in time order), the rollout, and each call's advantage (None
    when the trainer would not train on it, or the rollout is not a training rollout)."""
    from agentloop.adapter import spans_to_triplets, triplets_for_rollouts
    from agentloop.types import RolloutStatus
    from trainer import TrainerConfig, sample_advantages  # the CLI is where agentloop reaches the trainer

    config = run_config(run_dir)
    store = ReadOnlyStore(db if db is not None else run_dir / "store.db")
    try:
        rollout = await store.get_rollout(rollout_id)
        spans = await store.query_spans(rollout_id)
        calls = spans_to_triplets(spans, rollout=rollout).triplets
        advantages: list[float | None] = [None] * len(calls)
        if rollout.mode == "train" and rollout.status is RolloutStatus.SUCCEEDED:
            key = (rollout.metadata.get("step"), rollout.metadata.get("data_index"))
            group = [
                r.rollout_id
                for r in await store.list_rollouts()
                if r.mode == "train" and (r.metadata.get("step"), r.metadata.get("data_index")) == key
            ]
            cfg = TrainerConfig.from_dict(config)
            adapted = await triplets_for_rollouts(store, group, cfg.adapter.credit_assignment)  # type: ignore[arg-type]
            if not cfg.algorithm.use_kl_in_reward:
                by_call = dict(
                    zip(
                        (
                            (t.metadata.get("attempt_id"), t.metadata.get("call_index"))
                            for t in adapted.triplets
                        ),
                        sample_advantages(adapted.triplets, cfg),
                        strict=True,
                    )
                )
                advantages = [
                    by_call.get((t.metadata.get("attempt_id"), t.metadata.get("call_index"))) for t in calls
                ]
    finally:
        await store.close()
    return calls, rollout, advantages


def run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}
