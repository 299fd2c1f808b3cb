"""Queries the model writes, run so that they can only read, only for a while, and only so many rows.

The model's SQL is hostile input. Each query gets its own connection with four guards:

- **read-only, three ways**: the file is opened ``mode=ro``; an authorizer allows only reads
  (SELECT, reading columns, functions, recursive CTEs and a few introspection pragmas) and denies
  everything else at prepare time (INSERT/UPDATE/DELETE, CREATE, temp tables, ATTACH, PRAGMA writes,
  transactions); and no database may be attached (``SQLITE_LIMIT_ATTACHED = 0``), which also stops
  ``VACUUM INTO '/any/path'`` (it attaches its target internally; ``mode=ro`` alone let both
  ``VACUUM INTO`` and ``ATTACH 'file:...?mode=rwc'`` create files).
- **a deadline**: a progress handler, called every ``_PROGRESS_STEPS`` virtual-machine steps,
  interrupts the query once its deadline has passed, so ``WITH RECURSIVE`` without an end stops.
  SQLite releases the GIL while it steps, so a query in a worker thread never stalls the event loop.
- **a row cap**: rows are fetched ``fetchmany`` at a time up to the cap, so a cross join of a few
  tables is never materialised (``fetchall()`` built millions of tuples).
- **a size cap**: strings and blobs over ``MAX_VALUE_BYTES`` fail (``randomblob(1e9)`` allocated 1 GB).

Every refusal is a ``sqlite3.Error`` whose message says which rule was broken.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_RESULT_ROWS", "QueryLimitError", "connect", "fetch_rows"]

DEFAULT_TIMEOUT_S = 5.0  # the company database answers any sensible query in milliseconds
MAX_RESULT_ROWS = 10_000  # the database has 40 employees; more rows means a runaway join
MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: the largest string, blob or row
_PROGRESS_STEPS = 1_000  # VM steps between deadline checks (~10 us of work each; the check ~1 us)
_READ_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"}
)
_ALLOWED = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


class QueryLimitError(sqlite3.OperationalError):
    """A query ran past its deadline or returned more rows than allowed."""


def _authorize(
    action: int, arg1: str | None, arg2: str | None, db_name: str | None, source: str | None
) -> int:
    if action in _ALLOWED:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and arg1 in _READ_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY  # the statement fails to prepare: "not authorized"


def connect(db: str | Path) -> sqlite3.Connection:
    """A connection that can only read ``db`` (see the module docstring); close it after use."""
    path = Path(db).resolve()
    if not path.is_file():  # mode=ro never creates the file, but say so clearly
        raise sqlite3.OperationalError(f"no database file at {path}")
    con = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5, check_same_thread=False)
    con.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)  # no ATTACH, and no VACUUM INTO (it attaches)
    con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    con.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
    con.set_authorizer(_authorize)
    return con


def fetch_rows(
    db: str | Path, sql: str, *, max_rows: int = MAX_RESULT_ROWS, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[list[tuple[Any, ...]], bool]:
    """Run one read-only statement: ``(at most max_rows rows, whether more rows were left unread)``.

    Raises ``QueryLimitError`` when the deadline passes (the query is interrupted at once) and
    other ``sqlite3.Error``s for SQL that fails or is refused.
    """
    if timeout_s <= 0 or max_rows < 0:
        raise ValueError(f"timeout_s must be > 0 and max_rows >= 0, got {timeout_s} and {max_rows}")
    deadline = time.monotonic() + timeout_s
    con = connect(db)
    con.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_STEPS)  # nonzero: interrupt
    try:
        cursor = con.execute(sql)
        rows: list[tuple[Any, ...]] = []
        while len(rows) <= max_rows:  # one row past the cap says whether more were left
            batch = cursor.fetchmany(min(256, max_rows + 1 - len(rows)))
            if not batch:
                break
            rows.extend(tuple(r) for r in batch)
        return rows[:max_rows], len(rows) > max_rows
    except sqlite3.OperationalError as exc:
        if time.monotonic() > deadline and "interrupt" in str(exc):
            raise QueryLimitError(
                f"the query ran past its {timeout_s:g} s deadline and was stopped; "
                "write a query that finishes (a recursive CTE needs an end, joins need conditions)"
            ) from None
        raise
    finally:
        con.close()
