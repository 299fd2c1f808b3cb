"""Build the example's SQLite database deterministically: ``python -m examples.sql_agent.make_db out.db``.

A small company: departments, employees, projects and who works how many hours on what. The same
seed always gives the same rows, so the gold answers of ``questions.py`` never change.
"""

from __future__ import annotations

import random
import sqlite3
import sys
from pathlib import Path

SCHEMA = """
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE employees (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER NOT NULL REFERENCES departments(id),
    salary INTEGER NOT NULL, hired_year INTEGER NOT NULL
);
CREATE TABLE projects (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER NOT NULL REFERENCES departments(id),
    budget INTEGER NOT NULL
);
CREATE TABLE assignments (
    employee_id INTEGER NOT NULL REFERENCES employees(id), project_id INTEGER NOT NULL REFERENCES projects(id),
    hours INTEGER NOT NULL, PRIMARY KEY (employee_id, project_id)
);
"""

_DEPARTMENTS = [
    ("Engineering", "Berlin"), ("Sales", "Paris"), ("Marketing", "Paris"), ("Finance", "London"),
    ("Support", "Lisbon"), ("Research", "Berlin"),
]  # fmt: skip
_FIRST = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kira", "Liam"]
_LAST = ["Novak", "Okafor", "Petit", "Quinn", "Rossi", "Sato", "Tanaka", "Ueda", "Vargas", "Weber"]
_PROJECTS = ["Atlas", "Beacon", "Comet", "Delta", "Echo", "Falcon", "Granite", "Harbor", "Iris", "Juniper"]


def build_database(path: str | Path, seed: int = 0, employees: int = 40) -> Path:
    """Write the database to ``path`` (replaced if it exists) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    r = random.Random(seed)
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        con.executemany(
            "INSERT INTO departments VALUES (?, ?, ?)",
            [(i + 1, n, c) for i, (n, c) in enumerate(_DEPARTMENTS)],
        )
        names = sorted({f"{f} {la}" for f in _FIRST for la in _LAST})
        r.shuffle(names)
        con.executemany(
            "INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
            [
                (
                    i + 1,
                    names[i],
                    r.randint(1, len(_DEPARTMENTS)),
                    r.randrange(38_000, 140_000, 500),
                    r.randint(2012, 2024),
                )
                for i in range(employees)
            ],
        )
        con.executemany(
            "INSERT INTO projects VALUES (?, ?, ?, ?)",
            [
                (i + 1, n, r.randint(1, len(_DEPARTMENTS)), r.randrange(20_000, 500_000, 1000))
                for i, n in enumerate(_PROJECTS)
            ],
        )
        pairs = sorted(
            {(r.randint(1, employees), r.randint(1, len(_PROJECTS))) for _ in range(employees * 2)}
        )
        con.executemany(
            "INSERT INTO assignments VALUES (?, ?, ?)", [(e, p, r.randint(2, 40)) for e, p in pairs]
        )
        con.commit()
    finally:
        con.close()
    tmp.replace(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m examples.sql_agent.make_db OUT.db")
    print(build_database(sys.argv[1]))
