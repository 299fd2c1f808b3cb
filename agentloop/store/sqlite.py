"""SQLiteStore: the embedded, durable default store.

Durability: WAL journal with ``synchronous=FULL``; a call returns only after its transaction
committed, so a process killed at any moment (SIGKILL, power loss) loses no enqueue and no
finished rollout that a caller was told about.

Speed without weakening that: one connection owned by one dedicated thread
(agentloop/store/_sqlite_thread.py). Calls queue up on it; the thread runs every call waiting at
that moment in one transaction (a SAVEPOINT each, so one failing call does not undo the others),
commits once and only then answers them all (group commit). Several processes may open the same
file; writes take ``BEGIN IMMEDIATE`` and wait up to ``busy_timeout_s`` for each other.

Models are stored as JSON columns (never pickle); the FIFO queue is ordered by an
AUTOINCREMENT position, so a requeued rollout goes to the back.

Needs the asyncio event loop (the thread answers through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio

from agentloop.errors import AgentLoopError, InvalidRequestError, NotFoundError
from agentloop.private_files import private_file, tighten
from agentloop.resources import Resources, ResourcesLike
from agentloop.store import state
from agentloop.store._sqlite_thread import DURABLE, READ, WRITE, ConnectionThread, Op
from agentloop.store.base import RolloutWaiter
from agentloop.store.session_schema import SCHEMA as SESSION_SCHEMA
from agentloop.store.state import (
    parse_error,
    parse_ids,
    parse_limit,
    parse_resources,
    parse_span,
    parse_statuses,
    parse_version,
)
from agentloop.types import (
    JSON,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ErrorInfo,
    Rollout,
    RolloutMode,
    Span,
)

T = TypeVar("T")

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL UNIQUE, status TEXT NOT NULL,
    latest_attempt_id TEXT, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts(status);
CREATE TABLE IF NOT EXISTS queue (position INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, sequence_id INTEGER NOT NULL,
    deadline REAL, next_span INTEGER NOT NULL DEFAULT 1, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts(rollout_id, sequence_id);
CREATE INDEX IF NOT EXISTS attempts_by_deadline ON attempts(deadline) WHERE deadline IS NOT NULL;
CREATE TABLE IF NOT EXISTS spans (
    attempt_id TEXT NOT NULL, sequence_id INTEGER NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (attempt_id, sequence_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS resources (version INTEGER PRIMARY KEY, data TEXT NOT NULL);
"""
    + SESSION_SCHEMA
)


def _one(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> Any:
    row = conn.execute(sql, args).fetchone()
    return row


class SQLiteStore:
    """A Store in one SQLite file (created if missing). ``synchronous`` is FULL (survives power
    loss) or NORMAL (survives a killed process). ``clock`` lets tests move time by hand."""

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["FULL", "NORMAL"] = "FULL",
        busy_timeout_s: float = 30.0,
        poll_interval_s: float = 0.2,
        clock: state.Clock = time.time,
    ) -> None:
        if not isinstance(path, str | Path) or not str(path):
            raise InvalidRequestError(f"path must be a file path, got {path!r:.80}")
        if synchronous not in ("FULL", "NORMAL"):
            raise InvalidRequestError(f"synchronous must be 'FULL' or 'NORMAL', got {synchronous!r}")
        self.path = Path(path)
        _make_private(self.path)
        self._clock = clock
        self._poll_interval_s = poll_interval_s  # how often waiters look for other processes' writes
        self._worker = ConnectionThread(str(path), _SCHEMA, synchronous, busy_timeout_s, max_batch=512)
        self._worker.start()
        self._closed = False
        self._waiters: dict[str, list[RolloutWaiter]] = {}
        self._resources_cache: Resources | None = None  # read by the worker thread only

    async def _call(self, op: Op[T], mode: int = DURABLE) -> T:
        if self._closed:
            raise AgentLoopError(f"SQLiteStore({self.path}) is closed; open a new one")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[T, list[str]]] = loop.create_future()
        self._worker.jobs.put((op, mode, loop, fut))
        value, finished = await fut
        if finished:
            self._notify(finished)
        return value

    def submit(self, op: Op[T], mode: int = WRITE) -> concurrent.futures.Future[T]:
        """Queue ``op`` on the writer thread without waiting (from any thread, with or without an event
        loop); the future gets its value once its transaction committed. For writes whose caller waits
        later, such as ``SessionJournal``'s; ops that finish rollouts must go through the async calls."""
        if self._closed:
            raise AgentLoopError(f"SQLiteStore({self.path}) is closed; open a new one")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._worker.jobs.put((op, mode, None, fut))
        return fut

    def _notify(self, finished: list[str]) -> None:
        for rid in finished:
            for waiter in self._waiters.pop(rid, ()):
                waiter.pending.discard(rid)
                if not waiter.pending:
                    waiter.event.set()

    # ------------------------------------------------------------ row helpers (worker thread)

    def _load(self, conn: sqlite3.Connection, rollout_id: Any) -> tuple[Rollout, str | None]:
        state.require_id("rollout_id", rollout_id)
        row = _one(conn, "SELECT data, latest_attempt_id FROM rollouts WHERE rollout_id=?", (rollout_id,))
        if row is None:
            raise NotFoundError(f"rollout {rollout_id!r} not found")
        return Rollout.model_validate_json(row[0]), row[1]

    def _load_attempt(
        self, conn: sqlite3.Connection, rollout_id: str, attempt_id: Any
    ) -> tuple[Attempt, int]:
        state.require_id("attempt_id", attempt_id)
        sql = "SELECT data, next_span FROM attempts WHERE attempt_id=? AND rollout_id=?"
        row = _one(conn, sql, (attempt_id, rollout_id))
        if row is None:
            raise NotFoundError(f"attempt {attempt_id!r} of rollout {rollout_id!r} not found")
        return Attempt.model_validate_json(row[0]), row[1]

    def _save(self, conn: sqlite3.Connection, rollout: Rollout, attempt: Attempt | None = None) -> list[str]:
        """Write the new versions; keep the queue in step. Returns [rollout_id] if it just finished."""
        rid = rollout.rollout_id
        conn.execute(
            "UPDATE rollouts SET status=?, data=? WHERE rollout_id=?",
            (rollout.status, rollout.model_dump_json(), rid),
        )
        if attempt is not None:
            deadline = state.attempt_deadline(attempt, rollout.config)
            conn.execute(
                "UPDATE attempts SET data=?, deadline=? WHERE attempt_id=?",
                (attempt.model_dump_json(), deadline, attempt.attempt_id),
            )
        if rollout.status == "requeued":
            conn.execute("INSERT INTO queue(rollout_id) VALUES (?)", (rid,))
        elif rollout.status.is_terminal:
            conn.execute("DELETE FROM queue WHERE rollout_id=?", (rid,))
            return [rid]
        return []

    def _watchdog(self, conn: sqlite3.Connection) -> tuple[list[Attempt], list[str]]:
        now = self._clock()
        rows = conn.execute(
            "SELECT rollout_id, attempt_id FROM attempts WHERE deadline IS NOT NULL AND deadline < ?", (now,)
        ).fetchall()
        ended, finished = [], []
        for rid, aid in rows:
            rollout, _ = self._load(conn, rid)
            attempt, _ = self._load_attempt(conn, rid, aid)
            changed = state.run_watchdog(rollout, attempt, now)
            if changed is None:
                conn.execute("UPDATE attempts SET deadline=NULL WHERE attempt_id=?", (aid,))
                continue
            finished += self._save(conn, *changed)
            ended.append(changed[1])
        return ended, finished

    def _latest_resources(self, conn: sqlite3.Connection) -> Resources | None:
        row = _one(conn, "SELECT MAX(version) FROM resources", ())
        if row[0] is None:
            return None
        cached = self._resources_cache
        if cached is None or cached.version != row[0]:
            data = _one(conn, "SELECT data FROM resources WHERE version=?", (row[0],))[0]
            cached = self._resources_cache = Resources.model_validate_json(data)
        return cached

    # ------------------------------------------------------------ rollouts and attempts

    async def enqueue_rollout(
        self,
        input: JSON,
        mode: RolloutMode = "train",
        config: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        rollout = state.new_rollout(input, mode, config, metadata, self._clock())

        def op(conn: sqlite3.Connection) -> tuple[Rollout, list[str]]:
            conn.execute(
                "INSERT INTO rollouts(rollout_id, status, data) VALUES (?, ?, ?)",
                (rollout.rollout_id, rollout.status, rollout.model_dump_json()),
            )
            conn.execute("INSERT INTO queue(rollout_id) VALUES (?)", (rollout.rollout_id,))
            return rollout, []

        return await self._call(op)

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        if worker_id is not None:
            state.require_id("worker_id", worker_id)

        def op(conn: sqlite3.Connection) -> tuple[AttemptedRollout | None, list[str]]:
            _, finished = self._watchdog(conn)
            row = _one(
                conn,
                "DELETE FROM queue WHERE position=(SELECT MIN(position) FROM queue) RETURNING rollout_id",
                (),
            )
            if row is None:
                return None, finished
            rollout, _ = self._load(conn, row[0])
            rollout, attempt, attempted = state.start_attempt(
                rollout, worker_id, self._latest_resources(conn), self._clock()
            )
            conn.execute(
                "INSERT INTO attempts(attempt_id, rollout_id, sequence_id, data) VALUES (?, ?, ?, ?)",
                (attempt.attempt_id, rollout.rollout_id, attempt.sequence_id, "{}"),
            )
            conn.execute(
                "UPDATE rollouts SET latest_attempt_id=? WHERE rollout_id=?",
                (attempt.attempt_id, rollout.rollout_id),
            )
            return attempted, finished + self._save(conn, rollout, attempt)

        return await self._call(op, WRITE)

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | str | None = None,
        error: ErrorInfo | None = None,
        heartbeat: bool = False,
    ) -> Attempt:
        parsed, err = state.parse_attempt_status(status), parse_error(error)

        def op(conn: sqlite3.Connection) -> tuple[Attempt, list[str]]:
            rollout, latest = self._load(conn, rollout_id)
            attempt, _ = self._load_attempt(conn, rollout_id, attempt_id)
            rollout, attempt = state.update_attempt(
                rollout, attempt, latest, parsed, err, bool(heartbeat), self._clock()
            )
            return attempt, self._save(conn, rollout, attempt)

        return await self._call(op, DURABLE if parsed is not None and parsed.is_terminal else WRITE)

    async def add_span(self, span: Span) -> Span:
        span = parse_span(span)

        def op(conn: sqlite3.Connection) -> tuple[Span, list[str]]:
            rollout, latest = self._load(conn, span.rollout_id)
            attempt, next_span = self._load_attempt(conn, span.rollout_id, span.attempt_id)
            attempt, accepted = state.accept_span(rollout, attempt, latest, span, next_span, self._clock())
            seq = accepted.sequence_id
            conn.execute(
                "INSERT INTO spans(attempt_id, sequence_id, data) VALUES (?, ?, ?)",
                (attempt.attempt_id, seq, accepted.model_dump_json()),
            )
            conn.execute("UPDATE attempts SET next_span=? WHERE attempt_id=?", (seq + 1, attempt.attempt_id))  # type: ignore[operator]
            return accepted, self._save(conn, rollout, attempt)

        return await self._call(op, WRITE)

    async def query_spans(
        self, rollout_id: str, attempt_id: str | Literal["latest"] = "latest"
    ) -> list[Span]:
        def op(conn: sqlite3.Connection) -> tuple[list[Span], list[str]]:
            _, latest = self._load(conn, rollout_id)
            aid = (
                latest
                if attempt_id == "latest"
                else self._load_attempt(conn, rollout_id, attempt_id)[0].attempt_id
            )
            if aid is None:
                return [], []
            rows = conn.execute("SELECT data FROM spans WHERE attempt_id=? ORDER BY sequence_id", (aid,))
            return [Span.model_validate_json(r[0]) for r in rows], []

        return await self._call(op, mode=READ)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._call(lambda conn: (self._load(conn, rollout_id)[0], []), mode=READ)

    async def get_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        def op(conn: sqlite3.Connection) -> tuple[Attempt, list[str]]:
            self._load(conn, rollout_id)
            return self._load_attempt(conn, rollout_id, attempt_id)[0], []

        return await self._call(op, mode=READ)

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> tuple[Rollout, Attempt]:
        def op(conn: sqlite3.Connection) -> tuple[tuple[Rollout, Attempt], list[str]]:
            rollout = self._load(conn, rollout_id)[0]
            return (rollout, self._load_attempt(conn, rollout_id, attempt_id)[0]), []

        return await self._call(op, mode=READ)

    async def list_attempts(self, rollout_id: str) -> list[Attempt]:
        def op(conn: sqlite3.Connection) -> tuple[list[Attempt], list[str]]:
            self._load(conn, rollout_id)
            rows = conn.execute(
                "SELECT data FROM attempts WHERE rollout_id=? ORDER BY sequence_id", (rollout_id,)
            )
            return [Attempt.model_validate_json(r[0]) for r in rows], []

        return await self._call(op, mode=READ)

    async def list_rollouts(self, status: list[str] | None = None, limit: int | None = None) -> list[Rollout]:
        wanted, limit = parse_statuses(status), parse_limit(limit)
        sql, args = "SELECT data FROM rollouts", list[str | int]()
        if wanted is not None:
            sql += f" WHERE status IN ({','.join('?' * len(wanted))})" if wanted else " WHERE 0"
            args += [s.value for s in wanted]
        sql += " ORDER BY seq" + (" LIMIT ?" if limit is not None else "")
        args += [limit] if limit is not None else []

        def op(conn: sqlite3.Connection) -> tuple[list[Rollout], list[str]]:
            return [Rollout.model_validate_json(r[0]) for r in conn.execute(sql, args)], []

        return await self._call(op, mode=READ)

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        def op(conn: sqlite3.Connection) -> tuple[Rollout, list[str]]:
            rollout, latest = self._load(conn, rollout_id)
            attempt = self._load_attempt(conn, rollout_id, latest)[0] if latest else None
            rollout, attempt = state.cancel(rollout, attempt, self._clock())
            return rollout, self._save(conn, rollout, attempt)

        return await self._call(op)

    def _finished_op(self, ids: list[str], watchdog: bool) -> Op[list[Rollout]]:
        def op(conn: sqlite3.Connection) -> tuple[list[Rollout], list[str]]:
            finished = self._watchdog(conn)[1] if watchdog else []
            out = []
            for rid in ids:
                rollout, _ = self._load(conn, rid)
                if rollout.status.is_terminal:
                    out.append(rollout)
            return out, finished

        return op

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` that are finished once all are, or once ``timeout``
        seconds passed (0: at once). Wakes on this process's commits at once, and every
        ``poll_interval_s`` to see other processes' writes and run the watchdog."""
        ids, timeout = parse_ids(rollout_ids), state.require_timeout(timeout)
        waiter = RolloutWaiter(set(ids))
        for rid in ids:  # registered before reading, so no commit in between is missed
            self._waiters.setdefault(rid, []).append(waiter)
        try:
            deadline = time.monotonic() + timeout
            done = await self._call(self._finished_op(ids, watchdog=False), mode=READ)
            waiter.pending.difference_update(r.rollout_id for r in done)
            while waiter.pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                with anyio.move_on_after(min(remaining, self._poll_interval_s)):
                    await waiter.event.wait()
                if waiter.pending:
                    done = await self._call(self._finished_op(ids, watchdog=True))
                    waiter.pending.difference_update(r.rollout_id for r in done)
        finally:
            for rid in ids:
                waiters = self._waiters.get(rid)
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[rid]
        if len(done) == len(ids) or timeout == 0:
            return done
        return await self._call(self._finished_op(ids, watchdog=False), mode=READ)

    async def check_timeouts(self) -> list[Attempt]:
        return await self._call(self._watchdog)

    # ------------------------------------------------------------ resources

    async def add_resources(self, resources: ResourcesLike) -> int:
        parsed = parse_resources(resources)

        def op(conn: sqlite3.Connection) -> tuple[int, list[str]]:
            version = (_one(conn, "SELECT MAX(version) FROM resources", ())[0] or 0) + 1
            data = parsed.model_copy(update={"version": version}).model_dump_json()
            conn.execute("INSERT INTO resources(version, data) VALUES (?, ?)", (version, data))
            return version, []

        return await self._call(op)

    async def get_latest_resources(self) -> Resources | None:
        def op(conn: sqlite3.Connection) -> tuple[Resources | None, list[str]]:
            latest = self._latest_resources(conn)
            return (latest.model_copy(deep=True) if latest is not None else None), []

        return await self._call(op, mode=READ)

    async def get_resources(self, version: int) -> Resources:
        version = parse_version(version)

        def op(conn: sqlite3.Connection) -> tuple[Resources, list[str]]:
            row = _one(conn, "SELECT data FROM resources WHERE version=?", (version,))
            if row is None:
                raise NotFoundError(f"resources version {version} not found")
            return Resources.model_validate_json(row[0]), []

        return await self._call(op, mode=READ)

    async def close(self) -> None:
        """Finish the queued calls, close the connection and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._worker.jobs.put(None)
        await anyio.to_thread.run_sync(self._worker.join)


def _make_private(path: Path) -> None:
    """The database created 0600 before SQLite opens it (SQLite gives its -wal and -shm files the
    database's mode), or an existing one tightened with its -wal and -shm: it holds every task,
    rollout and token, and a served store every app conversation."""
    if str(path) == ":memory:" or str(path).startswith("file:"):
        return
    try:
        private_file(path)
    except OSError:
        return  # a folder that is missing or not writable: SQLite says so, in its own words
    for suffix in ("-wal", "-shm", "-journal"):
        tighten(path.with_name(path.name + suffix))
