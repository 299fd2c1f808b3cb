"""The SQL agent: a LangGraph ReAct agent (integrations.langgraph.ReactAgentLoop) with SQLite tools.

Reward: the agent's query is the last one it ran with ``run_query`` (or a fenced ```sql block in its
final message); it and the gold query are executed on the database and the reward is 1.0 when the
two result sets are equal (as sets of rows), else 0.0.

The model's SQL is hostile input: every query (tool or reward) runs through ``safe_sql.fetch_rows``:
read-only (an authorizer, no ATTACH or VACUUM INTO), stopped at a deadline, at most a capped number
of rows. The reward re-runs the model's SQL in a worker thread, never on the event loop.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import anyio
from langchain_core.messages import AIMessage
from langchain_core.tools import BaseTool, tool

from examples.sql_agent.safe_sql import (
    DEFAULT_TIMEOUT_S,
    MAX_RESULT_ROWS,
    QueryLimitError,
    connect,
    fetch_rows,
)
from integrations.langgraph import ReactAgentLoop

__all__ = ["SQLAgent", "agent_query", "connect", "execute", "make_tools", "same_result"]

SYSTEM_PROMPT = (
    "You answer questions about a SQLite database. Look at the tables with list_tables and describe_table, "
    "then run one SQL query with run_query that answers the question, and state the answer."
)
MAX_ROWS = 20  # rows shown to the model per query


def execute(db: Path, sql: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[Any, ...]]:
    """All rows of one read-only query; over MAX_RESULT_ROWS rows or the deadline raises QueryLimitError."""
    rows, more = fetch_rows(db, sql, max_rows=MAX_RESULT_ROWS, timeout_s=timeout_s)
    if more:
        raise QueryLimitError(
            f"the query returns more than {MAX_RESULT_ROWS} rows; add conditions or a LIMIT"
        )
    return rows


def make_tools(db: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[BaseTool]:
    """The three tools of the agent, bound to one database file; each query stops at ``timeout_s``."""

    @tool
    def list_tables() -> str:
        """List the tables of the database."""
        rows = execute(db, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        return ", ".join(r[0] for r in rows)

    @tool
    def describe_table(table: str) -> str:
        """Show the CREATE TABLE statement of a table.

        Args:
            table: the table name.
        """
        con = connect(db)
        try:
            row = con.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).fetchone()
        finally:
            con.close()
        return str(row[0]) if row else f"Error: no table named {table!r}; call list_tables"

    @tool
    def run_query(query: str) -> str:
        """Run a read-only SQL query and return its rows.

        Args:
            query: one SQLite SELECT statement.
        """
        try:  # only the rows shown are fetched: a cross join is never materialised
            rows, more = fetch_rows(db, query, max_rows=MAX_ROWS, timeout_s=timeout_s)
        except sqlite3.Error as exc:
            return f"Error: {type(exc).__name__}: {exc}"
        shown = "\n".join(str(r) for r in rows)
        return (shown + (f"\n... more rows (first {MAX_ROWS} shown)" if more else "")) or "(no rows)"

    return [list_tables, describe_table, run_query]


_FENCED = re.compile(r"```sql\s*(.+?)```", re.DOTALL | re.IGNORECASE)


def agent_query(final_state: Any) -> str | None:
    """The agent's answer query: its last run_query call, else a ```sql block in its last message."""
    if not final_state:
        return None
    messages = final_state.get("messages", [])
    for msg in reversed(messages):
        if isinstance(msg, AIMessage):
            for call in reversed(msg.tool_calls):
                if call["name"] == "run_query" and isinstance(call["args"].get("query"), str):
                    return str(call["args"]["query"])
    last = messages[-1] if messages else None
    if isinstance(last, AIMessage) and isinstance(last.content, str):
        fenced = _FENCED.findall(last.content)
        if fenced:
            return str(fenced[-1]).strip()
    return None


def same_result(db: Path, predicted: str | None, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when both queries run (each within ``timeout_s``) and return the same set of rows."""
    if not predicted:
        return False
    try:
        got = execute(db, predicted, timeout_s=timeout_s)
    except sqlite3.Error:  # refused, failed, too slow or too many rows: not the answer
        return False
    return set(got) == set(execute(db, gold, timeout_s=timeout_s))


class SQLAgent(ReactAgentLoop):
    """Answers ``{"question", "gold_sql"}`` tasks over ``db`` with the prebuilt LangGraph ReAct agent.

    ``query_timeout_s`` bounds every query the model's SQL causes: tool calls and the reward.
    """

    system_prompt = SYSTEM_PROMPT
    max_steps = 12

    def __init__(
        self,
        db: str | Path,
        sampling: dict[str, Any] | None = None,
        query_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.db = Path(db)
        if not self.db.is_file():
            raise FileNotFoundError(f"no database at {self.db}; build it with examples.sql_agent.make_db")
        if query_timeout_s <= 0:
            raise ValueError(f"query_timeout_s must be > 0 seconds, got {query_timeout_s}")
        self.query_timeout_s = query_timeout_s
        self.tools = make_tools(self.db, query_timeout_s)
        self.sampling = dict(sampling or {})

    async def reward(self, task: dict[str, Any], final_state: Any) -> float:
        """Re-runs the model's SQL in a worker thread (SQLite gives the GIL back while it steps), so the
        event loop keeps serving other rollouts; the query's own deadline ends the thread."""
        query = agent_query(final_state)
        same = await anyio.to_thread.run_sync(
            same_result, self.db, query, task["gold_sql"], self.query_timeout_s
        )
        return float(same)
