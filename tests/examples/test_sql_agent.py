"""sql_agent: the generated database, the result-set reward, a scripted LangGraph run and the CLI."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from langchain_core.messages import AIMessage

from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from examples._harness import run_rollouts
from examples.sql_agent import run
from examples.sql_agent.agent import SQLAgent, agent_query, execute, make_tools, same_result
from examples.sql_agent.make_db import build_database
from examples.sql_agent.questions import QUESTIONS, make_tasks
from examples.sql_agent.safe_sql import QueryLimitError
from tests.examples.checks import check_exact_tokens
from tests.integrations.scripted import scripted_engine, tool_call_text
from tests.loop_watch import watch_event_loop


def _dump(db: Path) -> str:
    con = sqlite3.connect(db)
    try:
        return "\n".join(con.iterdump())
    finally:
        con.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_database(tmp_path_factory.mktemp("sql") / "company.db")


def test_database_is_deterministic_and_gold_queries_run(db: Path, tmp_path: Path) -> None:
    again = build_database(tmp_path / "again.db")
    assert hashlib.sha256(_dump(db).encode()).digest() == hashlib.sha256(_dump(again).encode()).digest()
    for q in QUESTIONS:
        assert execute(db, q["gold_sql"]), q["question"]  # every gold query has an answer
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        execute(db, "DELETE FROM employees")


def test_reward_compares_result_sets(db: Path) -> None:
    gold = "SELECT name FROM departments WHERE city = 'Paris'"
    assert same_result(db, "SELECT name FROM departments WHERE city LIKE 'Par%' ORDER BY name DESC", gold)
    assert not same_result(db, "SELECT name FROM departments", gold)
    assert not same_result(db, "SELEC nonsense", gold) and not same_result(db, None, gold)
    state = {"messages": [AIMessage("", tool_calls=[{"name": "run_query", "args": {"query": "SELECT 1"}, "id": "a"}]),
                          AIMessage("so:\n```sql\nSELECT 2\n```")]}  # fmt: skip
    assert agent_query(state) == "SELECT 1"
    assert agent_query({"messages": [AIMessage("```sql\nSELECT 2\n```")]}) == "SELECT 2"
    tools = {t.name: t for t in make_tools(db)}
    assert "employees" in tools["list_tables"].invoke({})
    assert tools["run_query"].invoke({"query": "SELECT * FROM nope"}).startswith("Error:")


async def test_scripted_graph_run_answers_correctly(tiny_model_dir: Path, db: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tasks = make_tasks(2)  # count employees; Paris departments
    answers = {t["question"]: t["gold_sql"] for t in tasks}

    def script(prompt: str, turn: int) -> str:
        question = next(q for q in answers if q in prompt)
        if turn == 0:
            return tool_call_text("list_tables", {})
        if turn == 1:
            return tool_call_text("run_query", {"query": answers[question]})
        return "That is the answer."

    store = MemoryStore()
    with anyio.fail_after(60):
        summary = await run_rollouts(SQLAgent(db), tasks, scripted_engine(tok, script), store=store)
    assert summary["rewards"] == [1.0, 1.0] and summary["llm_calls"] == 6 and summary["samples"] == 2
    counts = await check_exact_tokens(store, summary["rollout_ids"])
    assert counts["masked"] == summary["masked_tokens"] > 0


@pytest.mark.e2e
def test_cli_runs_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--rollouts", "2", "--device", "cpu", "--max-tokens", "12",
            "--db", str(tmp_path / "c.db"), "--store", str(tmp_path / "s.db")]  # fmt: skip
    summary: dict[str, Any] = run.main(argv)
    assert summary["rollouts"] == 2 and summary["statuses"] == {"succeeded": 2}
    assert all(r in (0.0, 1.0) for r in summary["rewards"])

    async def check() -> dict[str, int]:
        store = SQLiteStore(str(tmp_path / "s.db"))
        try:
            return await check_exact_tokens(store, summary["rollout_ids"])
        finally:
            await store.close()

    assert anyio.run(check)["calls"] == summary["llm_calls"] >= 2


# ---------------------------------------------------------------- hostile SQL (issue 16)

HOSTILE_SQL = [
    "VACUUM INTO '{out}'",  # created a copy of the database anywhere on the old code
    "ATTACH 'file:{out}?mode=rwc' AS x",  # created an empty file anywhere on the old code
    "ATTACH '{out}' AS x",
    "PRAGMA journal_mode = WAL",
    "PRAGMA user_version = 7",
    "PRAGMA writable_schema = ON",
    "DELETE FROM employees",
    "UPDATE employees SET salary = 0",
    "INSERT INTO departments VALUES (99, 'x', 'y')",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t (x)",
    "DROP TABLE employees",
    "WITH x AS (SELECT 1) DELETE FROM employees",
    "BEGIN IMMEDIATE",
    "SELECT length(randomblob(200000000))",  # 200 MB allocated on the old code
]


@pytest.mark.parametrize("statement", HOSTILE_SQL)
def test_the_models_sql_can_only_read(db: Path, tmp_path: Path, statement: str) -> None:
    before = _dump(db)
    sql = statement.format(out=tmp_path / "out.db")
    with pytest.raises(sqlite3.Error):
        execute(db, sql)
    tools = {t.name: t for t in make_tools(db)}
    assert tools["run_query"].invoke({"query": sql}).startswith("Error: ")
    assert list(tmp_path.iterdir()) == []  # no file was created
    assert _dump(db) == before


FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def test_a_query_without_an_end_is_stopped_at_its_deadline(db: Path) -> None:
    start = time.monotonic()
    with pytest.raises(QueryLimitError, match=r"ran past its 0\.5 s deadline and was stopped"):
        execute(db, FOREVER, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 1.5
    run_query = {t.name: t for t in make_tools(db, timeout_s=0.5)}["run_query"]
    start = time.monotonic()
    assert run_query.invoke({"query": FOREVER}).startswith(
        "Error: QueryLimitError: the query ran past its 0.5 s"
    )
    assert 0.5 <= time.monotonic() - start < 1.5


def test_runaway_results_are_never_materialised(db: Path) -> None:
    cross = (
        "SELECT a.id, b.id, c.id, d.id FROM employees a, employees b, employees c, employees d"  # 2.56 M rows
    )
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"
    run_query = {t.name: t for t in make_tools(db)}["run_query"]
    for sql in (cross, endless):
        start = time.monotonic()
        with pytest.raises(QueryLimitError, match="returns more than 10000 rows"):
            execute(db, sql)
        text = run_query.invoke({"query": sql})
        assert time.monotonic() - start < 1.0, sql  # fetchall() built every row of the cross join
        assert text.count("\n") == 20 and text.endswith("... more rows (first 20 shown)"), text
    assert not same_result(db, cross, "SELECT 1")


async def test_the_reward_reruns_the_models_sql_off_the_event_loop(db: Path) -> None:
    agent = SQLAgent(db, query_timeout_s=1.0)
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000000) SELECT count(*) FROM c"

    def state(query: str) -> dict[str, Any]:
        return {
            "messages": [
                AIMessage("", tool_calls=[{"name": "run_query", "args": {"query": query}, "id": "a"}])
            ]
        }

    task = {"question": "How many departments are there?", "gold_sql": "SELECT count(*) FROM departments"}
    async with watch_event_loop() as gaps:
        start = time.monotonic()
        reward = await agent.reward(task, state(slow))
        elapsed = time.monotonic() - start
    assert reward == 0.0
    assert 1.0 <= elapsed < 2.0, elapsed  # the model's query stopped at its deadline
    assert max(gaps) < 0.5, max(gaps)  # and the loop kept ticking meanwhile
    assert await agent.reward(task, state("SELECT count(id) FROM departments")) == 1.0
