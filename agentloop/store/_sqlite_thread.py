"""The SQLite store's connection thread: one connection owned by one thread, running every call waiting
at that moment in one transaction (a SAVEPOINT each) and answering them only after the commit (group
commit). Why the store works this way is in agentloop/store/sqlite.py's docstring."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agentloop.errors import AgentLoopError
from agentloop.event_loop import call_soon_from_thread

log = structlog.get_logger("agentloop.store.sqlite")
T = TypeVar("T")
# A call's needs: READ (no write lock), WRITE (commit, no fsync: survives a killed process), DURABLE
# (commit with fsync under synchronous=FULL: survives power loss). WAL is one ordered log, so the fsync of
# a durable commit also makes every earlier commit durable.
READ, WRITE, DURABLE = 0, 1, 2
Op = Callable[[sqlite3.Connection], tuple[T, list[str]]]  # returns (value, ids of rollouts that finished)
# (op, mode, the caller's loop and its future) or (op, mode, None, a thread-safe future: SQLiteStore.submit)
Job = (
    tuple[Op[Any], int, asyncio.AbstractEventLoop, asyncio.Future[Any]]
    | tuple[Op[Any], int, None, concurrent.futures.Future[Any]]
)


class ConnectionThread(threading.Thread):
    """The one thread that owns the connection and runs calls in group-committed batches of up to
    ``max_batch``; ``schema`` is run once at start. Put Jobs on ``jobs``; None stops it after the batch."""

    def __init__(
        self, path: str, schema: str, synchronous: str, busy_timeout_s: float, max_batch: int
    ) -> None:
        super().__init__(name=f"agentloop-sqlite:{Path(path).name}", daemon=True)
        self.jobs: queue.SimpleQueue[Job | None]
        self.jobs = queue.SimpleQueue()
        self.max_batch = max_batch
        self.conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        self.synchronous, self.full = synchronous, synchronous == "FULL"
        self.conn.execute("PRAGMA foreign_keys=OFF")
        self.conn.executescript("BEGIN IMMEDIATE;" + schema + "COMMIT;")

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            batch = [job]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._run_batch(batch)
        self.conn.close()

    def _run_batch(self, batch: list[Job]) -> None:
        conn = self.conn
        outcomes: list[tuple[bool, Any]] = []
        try:
            mode = max(m for _, m, _, _ in batch)
            full = mode == DURABLE and self.synchronous == "FULL"
            if full != self.full:  # fsync only commits that hold an enqueue or a finished rollout
                conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
                self.full = full
            conn.execute("BEGIN" if mode == READ else "BEGIN IMMEDIATE")
            for op, _, _, _ in batch:
                conn.execute("SAVEPOINT op")
                try:
                    outcomes.append((True, op(conn)))
                except Exception as exc:
                    conn.execute("ROLLBACK TO op")
                    outcomes.append((False, exc))
                conn.execute("RELEASE op")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:  # nothing of this batch was committed: every caller hears so
            log.error("sqlite batch failed", error=str(exc), calls=len(batch))
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            err = AgentLoopError(f"SQLite store failed, nothing of this call was saved: {exc}")
            outcomes = [(False, err)] * len(batch)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for (_, _, loop, fut), (ok, value) in zip(batch, outcomes, strict=True):
            if isinstance(fut, concurrent.futures.Future):  # from SQLiteStore.submit: answered from here
                _settle(fut, ok, value[0] if ok else value)
            elif loop is not None:
                by_loop.setdefault(loop, []).append((fut, ok, value))
        for loop, answers in by_loop.items():
            call_soon_from_thread(loop, _deliver, answers)  # a closed loop: nobody is waiting


def _deliver(answers: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for fut, ok, value in answers:
        if fut.cancelled():
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def _settle(fut: concurrent.futures.Future[Any], ok: bool, value: Any) -> None:
    if fut.set_running_or_notify_cancel():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
