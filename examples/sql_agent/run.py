"""Run sql_agent rollouts: ``python -m examples.sql_agent.run --rollouts 4`` (prints a JSON summary).

The database is generated (deterministically, by make_db.py) into a temporary folder unless --db names
a file to build.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python examples/sql_agent/run.py` works too
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._harness import parser, run_cli
from examples.sql_agent.agent import SQLAgent
from examples.sql_agent.make_db import build_database
from examples.sql_agent.questions import make_tasks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("sql_agent: a LangGraph agent answering questions over a SQLite database")
    p.add_argument("--db", default=None, help="where to build the database (default: a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentloop-sql-") as tmp:
        db = build_database(args.db or Path(tmp) / "company.db", seed=args.seed)
        return run_cli(args, SQLAgent(db), make_tasks(args.rollouts))


if __name__ == "__main__":
    main()
