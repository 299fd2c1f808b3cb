"""``agentloop inspect RUN --errors`` (issue 46): a run whose agent raised lists its failed attempts with
the line of the user's code and the traceback, agentloop's frames folded; the command in a subprocess on
a store a real Runner wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio

from agentloop.runner import Runner
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import RolloutConfig

AGENT = """
import agentloop as al


def score(task):
    return float(task["answr"] == "4")


@al.rollout
async def agent(task, llm):
    if task.get("slow"):
        raise TimeoutError("the tool took too long")
    return score(task)
"""


def _run_dir(tmp_path: Path) -> Path:
    """A run folder whose store holds 3 rollouts x 2 attempts: 4 KeyErrors and 2 TimeoutErrors."""
    (tmp_path / "my_agent.py").write_text(AGENT)
    sys.path.insert(0, str(tmp_path))
    try:
        from my_agent import agent  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()

    async def main() -> None:
        store = SQLiteStore(run / "store.db")
        for task in ({"answer": "4"}, {"answer": "5"}, {"slow": True}):
            await store.enqueue_rollout(task, config=RolloutConfig(max_attempts=2))
        await Runner(agent, store, concurrency=2).run(max_rollouts=6)
        await store.close()

    anyio.run(main)
    return run


def _inspect(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agentloop.cli", "inspect", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_errors_lists_failed_attempts_with_the_users_line_and_traceback(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = _inspect("run", "--errors", cwd=tmp_path)
    lines = out.splitlines()
    assert lines[0] == "6 failed attempts of 6 in run, 2 kinds of error"
    rows = [line for line in lines if line.startswith("ro-")]
    assert len(rows) == 6
    assert sum("my_agent.py:6 in score" in r and "KeyError: 'answr'" in r for r in rows) == 4
    assert (
        sum("my_agent.py:12 in agent" in r and "TimeoutError: the tool took too long" in r for r in rows) == 2
    )
    assert "KeyError: 'answr': 4 attempts; the first (rollout ro-" in out
    assert "TimeoutError: the tool took too long: 2 attempts; the first" in out
    assert "frames of agentloop hidden]" in out and "agentloop/runner.py" not in out  # folded
    assert f'File "{tmp_path / "my_agent.py"}", line 6, in score' in out
    assert '    return float(task["answr"] == "4")' in out  # the user's source line

    rid = rows[0].split()[0]
    full = _inspect(str(run), "--errors", "--rollout", rid, cwd=tmp_path)  # one rollout: in full
    assert full.splitlines()[0] == f"2 failed attempts of 6 in {run}, 1 kind of error"
    assert full.count("Traceback (most recent call last):") == 2 and "agentloop/runner.py" in full

    plain = _inspect("run", cwd=tmp_path)  # no LLM call anywhere: point at --errors
    assert "3 failed: `agentloop inspect run --errors` shows where the agent raised" in plain


def test_errors_of_a_run_without_failures(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()

    async def main() -> None:
        store = SQLiteStore(run / "store.db")
        await store.enqueue_rollout({"answr": "4"})
        from my_agent_ok import agent  # type: ignore[import-not-found]

        await Runner(agent, store).run(max_rollouts=1)
        await store.close()

    (tmp_path / "my_agent_ok.py").write_text(AGENT)
    sys.path.insert(0, str(tmp_path))
    try:
        anyio.run(main)
    finally:
        sys.path.remove(str(tmp_path))
    assert _inspect("run", "--errors", cwd=tmp_path) == "no failed attempt in run (1 attempt)\n"
