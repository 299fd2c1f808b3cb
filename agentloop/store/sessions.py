"""App sessions inside a SQLite store: the tables, the writer a proxy uses, and a reader.

``agentloop serve --store X.db`` keeps the calls and rewards of app sessions (traffic on the plain
``/v1`` routes) in X.db itself, beside the rollouts: three tables,

- ``sessions``: one row per session (``created_at``, ``updated_at``, its rewards as a JSON list);
- ``session_calls``: one row per recorded call (the ``LLMCall`` JSON, token ids included), in order;
- ``session_owners``: the owner of each session (a fingerprint of the key that created it, never the
  key; agentloop/proxy/access.py); a table of its own so that stores made before owners open as they are;
- ``store_meta``: ``serve`` -> the served model and tokenizer folder (what ``inspect`` decodes with);
- ``session_trained``: sessions an online update (``serve --train``) took, kept for audit under an
  archive id: the run folder, the update's number, then its outcome (``promoted`` with the version it
  became, ``rejected`` by the gate, or ``failed``). They never come back into the live table.

The proxy's ``SessionTable`` holds the live sessions in memory and applies the caps; it tells a
``SessionJournal`` every change (a call, a trim, the rewards, a drop), which the store's writer thread
runs in its group-committed transactions, and waits for it (``flush``) before answering the app, so a
killed server loses nothing it answered (as with spans, an OS crash may lose the last commits).
``read_sessions`` reads them back: when ``serve`` restarts, and for ``agentloop inspect`` (read-only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from agentloop.logging import get_logger
from agentloop.store.session_schema import SCHEMA  # noqa: F401  (agentloop.store.sessions.SCHEMA, as before)

if TYPE_CHECKING:
    from agentloop.store.sqlite import SQLiteStore

log = get_logger(__name__)


@dataclass(frozen=True)
class Trained:
    """The online update that trained on a session: its number, outcome and the version it became."""

    update: int
    run: str  # the online run folder (its versions/ hold the weights)
    at: float
    outcome: str  # "training" (in progress, or the server stopped), "promoted", "rejected", "failed", "empty"
    version: int | None = None  # the promoted version, for outcome "promoted"


@dataclass
class SavedSession:
    """One session as the store holds it: its calls as ``LLMCall`` JSON, its rewards as dicts."""

    session_id: str
    created_at: float
    updated_at: float
    calls: list[bytes] = field(default_factory=list)
    rewards: list[dict[str, Any]] = field(default_factory=list)
    owner: str = ""  # the fingerprint of the key that created it ("": none, or saved before owners)
    trained: Trained | None = None  # the online update that took it (None: not trained on)


def read_sessions(path: str | Path, *, read_only: bool = True) -> tuple[dict[str, Any], list[SavedSession]]:
    """The ``serve`` meta (model, tokenizer; ``{}`` if none) and every session in the store at ``path``,
    least recently used first. A store written before sessions lived in it has none."""
    uri = f"{Path(path).resolve().as_uri()}?mode=ro" if read_only else str(path)
    conn = sqlite3.connect(uri, uri=read_only, timeout=30.0)
    try:
        try:
            meta_row = conn.execute("SELECT value FROM store_meta WHERE key='serve'").fetchone()
            rows = conn.execute(
                "SELECT session_id, created_at, updated_at, rewards FROM sessions ORDER BY updated_at"
            ).fetchall()
            calls = conn.execute("SELECT session_id, data FROM session_calls ORDER BY id").fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return {}, []
            raise
        owners = dict(_rows_if_table(conn, "SELECT session_id, owner FROM session_owners"))
        trained = {
            sid: Trained(int(u), str(run), float(at), str(outcome), None if version is None else int(version))
            for sid, u, run, at, outcome, version in _rows_if_table(
                conn,
                "SELECT session_id, update_index, run, trained_at, outcome, version FROM session_trained",
            )
        }
    finally:
        conn.close()
    meta = orjson.loads(meta_row[0]) if meta_row else {}
    sessions = {
        sid: SavedSession(
            sid,
            float(created),
            float(updated),
            rewards=orjson.loads(rewards),
            owner=str(owners.get(sid, "")),
            trained=trained.get(sid),
        )
        for sid, created, updated, rewards in rows
    }
    for sid, data in calls:
        if sid in sessions:
            sessions[sid].calls.append(bytes(data))
    return (meta if isinstance(meta, dict) else {}), list(sessions.values())


def _rows_if_table(conn: sqlite3.Connection, sql: str) -> list[Any]:
    """``sql``'s rows, or none when its table is missing (a store written before it, opened read-only)."""
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return []


class SessionJournal:
    """Writes a ``SessionTable``'s changes into a SQLiteStore. Each method queues one statement on the
    store's writer thread and returns at once (callable from the event loop or a plain thread);
    ``flush`` waits until everything queued so far is committed and raises the first failure."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.path = store.path
        self._pending: list[concurrent.futures.Future[Any]] = []

    def _queue(self, sql: str, *rows: tuple[Any, ...]) -> None:
        def op(conn: sqlite3.Connection) -> tuple[None, list[str]]:
            for args in rows:
                conn.execute(sql, args)
            return None, []

        self._add(self.store.submit(op))

    def _add(self, fut: concurrent.futures.Future[Any]) -> None:
        if len(self._pending) >= 256:  # changes nobody flushed (drops on expiry): forget the finished ones
            self._pending = [f for f in self._pending if not f.done()]
        fut.add_done_callback(_log_failure)
        self._pending.append(fut)

    def set_server(self, info: dict[str, Any]) -> None:
        """Record what serves the sessions (model name, tokenizer folder) for readers to decode with."""
        self._queue(
            "INSERT INTO store_meta(key, value) VALUES('serve', ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (orjson.dumps(info).decode(),),
        )

    def call(self, session_id: str, call_json: bytes, at: float, created_at: float, owner: str = "") -> None:
        def op(conn: sqlite3.Connection) -> tuple[None, list[str]]:
            conn.execute(
                "INSERT INTO sessions(session_id, created_at, updated_at) VALUES(?, ?, ?) "
                "ON CONFLICT(session_id) DO UPDATE SET updated_at=excluded.updated_at",
                (session_id, created_at, at),
            )
            if owner:
                conn.execute(
                    "INSERT OR IGNORE INTO session_owners(session_id, owner) VALUES(?, ?)",
                    (session_id, owner),
                )
            conn.execute("INSERT INTO session_calls(session_id, data) VALUES(?, ?)", (session_id, call_json))
            return None, []

        self._add(self.store.submit(op))

    def trim(self, session_id: str, keep: int) -> None:
        """Keep only the ``keep`` newest calls of a session."""
        self._queue(
            "DELETE FROM session_calls WHERE session_id=? AND id NOT IN "
            "(SELECT id FROM session_calls WHERE session_id=? ORDER BY id DESC LIMIT ?)",
            (session_id, session_id, keep),
        )

    def rewards(self, session_id: str, rewards: list[dict[str, Any]], at: float) -> None:
        self._queue(
            "UPDATE sessions SET rewards=?, updated_at=? WHERE session_id=?",
            (orjson.dumps(rewards).decode(), at, session_id),
        )

    def owner(self, session_id: str, owner: str) -> None:
        """Set a session's owner (a key's fingerprint)."""
        self._queue(
            "INSERT INTO session_owners(session_id, owner) VALUES(?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET owner=excluded.owner",
            (session_id, owner),
        )

    def trained(self, session_id: str, update: int, run: str, at: float) -> str:
        """Keep a session an online update took, under an archive id (``<id>#u<update>-<time>``, so an app
        that reuses the id starts afresh), marked with the update and run folder; returns the archive id."""
        archive = f"{session_id}#u{update}-{at:.3f}"

        def op(conn: sqlite3.Connection) -> tuple[None, list[str]]:
            for table in ("sessions", "session_calls", "session_owners"):
                conn.execute(f"UPDATE {table} SET session_id=? WHERE session_id=?", (archive, session_id))
            conn.execute(
                "INSERT OR REPLACE INTO session_trained(session_id, update_index, run, trained_at) "
                "VALUES(?, ?, ?, ?)",
                (archive, update, run, at),
            )
            return None, []

        self._add(self.store.submit(op))
        return archive

    def update_outcome(self, update: int, run: str, outcome: str, version: int | None = None) -> None:
        """Record what became of update ``update`` of ``run``: ``promoted`` (as ``version``), ``rejected``
        or ``failed``."""
        self._queue(
            "UPDATE session_trained SET outcome=?, version=? WHERE update_index=? AND run=?",
            (outcome, version, update, run),
        )

    def drop(self, session_id: str) -> None:
        def op(conn: sqlite3.Connection) -> tuple[None, list[str]]:
            conn.execute("DELETE FROM session_calls WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM sessions WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM session_owners WHERE session_id=?", (session_id,))
            return None, []

        self._add(self.store.submit(op))

    def _settle(self, waited: list[concurrent.futures.Future[Any]]) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        for fut in waited:
            if not fut.done():
                raise TimeoutError("the store did not save the session changes in time")
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    async def flush(self) -> None:
        """Wait until every change queued so far is committed; raise the first failure among them.
        Concurrent callers each wait for all of them (a change is answered only once it is saved)."""
        waited = list(self._pending)
        if waited:
            await asyncio.wait([asyncio.wrap_future(f) for f in waited])
            self._settle(waited)

    def flush_sync(self, timeout: float = 30.0) -> None:
        """``flush`` for code outside the event loop (the writer thread answers these futures itself)."""
        waited = list(self._pending)
        concurrent.futures.wait(waited, timeout)
        self._settle(waited)


def _log_failure(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("session change not saved in the store", error=str(fut.exception()))
