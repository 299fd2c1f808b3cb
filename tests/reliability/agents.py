"""Agents and child processes for the fault tests (real processes, real signals).

``python -m tests.reliability.agents store DB PORT URL_FILE``: a StoreServer over a SQLiteStore.
``python -m tests.reliability.agents runner STORE_URL``: a Runner (StoreClient) of ``chat_agent``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import openai

from agentloop.agent import emit_reward, rollout
from agentloop.resources import LLM
from agentloop.runner import Runner
from agentloop.store.client import StoreClient
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout


@rollout
async def chat_agent(task: dict[str, Any], llm: LLM, ro: AttemptedRollout) -> float:
    """``task["turns"]`` chat calls through the proxy; with ``task["hang_after"]`` the first attempt
    writes ``task["marker"]`` after that many calls and hangs (to be killed)."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=5, timeout=30)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"question {task['q']}"}]
    try:
        for turn in range(task.get("turns", 2)):
            resp = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=16)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            messages.append({"role": "user", "content": f"turn {turn + 1}"})
            if ro.attempt.sequence_id == 1 and task.get("hang_after") == turn + 1:
                Path(task["marker"]).write_text(ro.attempt.attempt_id)
                await anyio.sleep(3600)
    finally:
        await client.close()
    return 1.0


@rollout
async def reward_agent(task: dict[str, Any], llm: Any) -> None:
    """No LLM: three reward spans with a short pause between them (store traffic only)."""
    for i in range(3):
        await emit_reward(float(i), name=f"step{i}")
        await anyio.sleep(task.get("pause_s", 0.02))


async def _serve_store(db: str, port: int, url_file: str) -> None:
    store = SQLiteStore(db)
    async with StoreServer(store, port=port) as server:
        Path(url_file).write_text(server.url)
        await anyio.sleep_forever()


async def _run_runner(store_url: str) -> None:
    async with StoreClient(store_url, timeout=10) as client:
        await Runner(chat_agent, client, concurrency=4, worker_id="doomed-runner").run()


if __name__ == "__main__":
    if sys.argv[1] == "store":
        anyio.run(_serve_store, sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "runner":
        anyio.run(_run_runner, sys.argv[2])
    else:
        raise SystemExit(f"unknown role {sys.argv[1]!r}; use store or runner")
