"""Run sql_agent rollouts: ``python -m examples.sql_agent.run --rollouts 4`` (prints a JSON summary).

The database is generated (deterministically, by make_db.py) into a temporary folder unless --db names
a file to build.

``--reward judge``: the agent gives no reward; an LLM judge (the served model, or ``--judge-url`` +
``--judge-model``) scores each task's ``--group`` attempts relative to each other, and the summary
compares its scores with the checker's verdicts. With ``--train STEPS`` the trainer is given the judge
(``fit(reward=...)``) instead of the checker.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python examples/sql_agent/run.py` works too
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._harness import parser, run_cli, train
from examples.sql_agent.agent import SQLAgent
from examples.sql_agent.judge import JudgedSQLAgent, judged_run, make_judge
from examples.sql_agent.make_db import build_database
from examples.sql_agent.questions import make_tasks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("sql_agent: a LangGraph agent answering questions over a SQLite database")
    p.add_argument("--db", default=None, help="where to build the database (default: a temporary folder)")
    p.add_argument(
        "--reward", choices=["checker", "judge"], default="checker", help="who scores the attempts"
    )
    p.add_argument("--group", type=int, default=4, help="--reward judge: attempts per task, judged together")
    p.add_argument(
        "--judge-url", default=None, help="the judge's OpenAI-compatible base URL (default: served)"
    )
    p.add_argument("--judge-model", default=None, help="the judge's model name (with --judge-url)")
    p.add_argument("--judge-key", default="EMPTY", help="the judge's API key (with --judge-url)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentloop-sql-") as tmp:
        db = build_database(args.db or Path(tmp) / "company.db", seed=args.seed)
        tasks = make_tasks(args.rollouts)
        if args.reward == "checker":
            return run_cli(args, SQLAgent(db), tasks)
        judge = make_judge(_judge_llm(args))
        if args.train:
            return train(args, JudgedSQLAgent(db), tasks, reward=judge)
        return _judged(args, db, tasks, judge)


def _judge_llm(args: Any) -> Any:
    if args.judge_url is None:
        return None
    if not args.judge_model:
        raise SystemExit("--judge-url needs --judge-model (the model name the endpoint serves)")
    import agentloop as al

    return al.LLM(base_url=args.judge_url, model=args.judge_model, api_key=args.judge_key)


def _judged(args: Any, db: Path, tasks: list[dict[str, str]], judge: Any) -> dict[str, Any]:
    import json

    import anyio

    from agentloop.engine.factory import load_engine

    engine = load_engine(args.model, device=args.device)
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    summary = anyio.run(
        lambda: judged_run(
            db, tasks, engine, judge, group=args.group, concurrency=args.concurrency, sampling=sampling
        )
    )
    print(json.dumps(summary, indent=2, default=str))  # the script's output: a JSON summary
    return summary


if __name__ == "__main__":
    main()
