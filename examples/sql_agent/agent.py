"""The SQL agent: a LangGraph ReAct agent (integrations.langgraph.ReactAgentLoop) with SQLite tools.

Reward: the agent's query is the last one it ran with ``run_query`` (or a fenced ```sql block in its
final message); it and the gold query are executed on the database and the reward is 1.0 when the
two result sets are equal (as sets of rows), else 0.0.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.tools import BaseTool, tool

from integrations.langgraph import ReactAgentLoop

SYSTEM_PROMPT = (
    "You answer questions about a SQLite database. Look at the tables with list_tables and describe_table, "
    "then run one SQL query with run_query that answers the question, and state the answer."
)
MAX_ROWS = 20  # rows shown to the model per query


def connect(db: Path) -> sqlite3.Connection:
    """A read-only connection: the agent cannot change the database."""
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)


def execute(db: Path, sql: str) -> list[tuple[Any, ...]]:
    con = connect(db)
    try:
        return [tuple(row) for row in con.execute(sql).fetchall()]
    finally:
        con.close()


def make_tools(db: Path) -> list[BaseTool]:
    """The three tools of the agent, bound to one database file."""

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
        rows = execute(
            db,
            f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{table.replace(chr(39), '')}'",
        )
        return rows[0][0] if rows else f"Error: no table named {table!r}; call list_tables"

    @tool
    def run_query(query: str) -> str:
        """Run a read-only SQL query and return its rows.

        Args:
            query: one SQLite SELECT statement.
        """
        try:
            rows = execute(db, query)
        except sqlite3.Error as exc:
            return f"Error: {type(exc).__name__}: {exc}"
        shown = "\n".join(str(r) for r in rows[:MAX_ROWS])
        more = f"\n... {len(rows) - MAX_ROWS} more rows" if len(rows) > MAX_ROWS else ""
        return (shown + more) or "(no rows)"

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


def same_result(db: Path, predicted: str | None, gold: str) -> bool:
    """True when both queries run and return the same set of rows."""
    if not predicted:
        return False
    try:
        got = execute(db, predicted)
    except sqlite3.Error:
        return False
    return set(got) == set(execute(db, gold))


class SQLAgent(ReactAgentLoop):
    """Answers ``{"question", "gold_sql"}`` tasks over ``db`` with the prebuilt LangGraph ReAct agent."""

    system_prompt = SYSTEM_PROMPT
    max_steps = 12

    def __init__(self, db: str | Path, sampling: dict[str, Any] | None = None) -> None:
        self.db = Path(db)
        if not self.db.is_file():
            raise FileNotFoundError(f"no database at {self.db}; build it with examples.sql_agent.make_db")
        self.tools = make_tools(self.db)
        self.sampling = dict(sampling or {})

    def reward(self, task: dict[str, Any], final_state: Any) -> float:
        return float(same_result(self.db, agent_query(final_state), task["gold_sql"]))
