"""Agents for the runner and agent tests; ``python -m tests.runner_fixtures DB N async|sync`` runs a runner process
with long agents on a SQLite store (the signal test sends it SIGTERM/SIGINT)."""

from __future__ import annotations

import sys
import time
from typing import Any

import anyio

from agentloop.agent import rollout
from agentloop.resources import LLM


@rollout
async def echo_agent(task: dict[str, Any], llm: LLM | None) -> float:
    """Returns the task's ``reward`` field (module-level, so it pickles by reference)."""
    return float(task["reward"])


@rollout
async def long_agent(task: dict[str, Any], llm: LLM | None) -> float:
    """Announces itself on stdout, then runs far longer than any test waits."""
    print(f"started {task['i']}", flush=True)
    await anyio.sleep(3600)
    return 1.0


@rollout
def long_sync_agent(task: dict[str, Any], llm: LLM | None) -> float:
    """The same in a worker thread, which cannot be interrupted: the runner abandons it on stop."""
    print(f"started {task['i']}", flush=True)
    time.sleep(3600)
    return 1.0


async def _serve(db: str, concurrency: int, kind: str) -> None:
    from agentloop.runner import Runner
    from agentloop.store.sqlite import SQLiteStore

    store = SQLiteStore(db)
    try:
        runner = Runner(
            long_sync_agent if kind == "sync" else long_agent,
            store,
            concurrency=concurrency,
            poll_interval=0.02,
        )
        stats = await runner.run(handle_signals=True)
        print(f"stopped {stats.stopped}", flush=True)
    finally:
        await store.close()


if __name__ == "__main__":
    anyio.run(_serve, sys.argv[1], int(sys.argv[2]), sys.argv[3])
