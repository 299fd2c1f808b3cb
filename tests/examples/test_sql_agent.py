"""sql_agent: the generated database, the result-set reward, a scripted LangGraph run and the CLI."""

from __future__ import annotations

import hashlib
import sqlite3
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
from tests.examples.checks import check_exact_tokens
from tests.integrations.scripted import scripted_engine, tool_call_text


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
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
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
