"""Load: N simulated agents x T turns through a real proxy (instant EchoEngine) into a SQLite store.

Used by tests/reliability/test_load.py (small) and benchmarks/reliability.py (1000 agents).
"""

from __future__ import annotations

import gc
import resource
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentloop.agent import rollout
from agentloop.resources import LLM, Resources
from agentloop.runner import Runner
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import RolloutStatus
from tests.proxy.engines import EchoEngine
from tests.reliability.conftest import running_proxy


def rss_mb() -> float:
    """Current resident set size (Linux /proc), MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def run_load(tokenizer: Any, db: Path, agents: int, turns: int) -> dict[str, Any]:
    """Run ``agents`` rollouts of ``turns`` chat calls each, all at once; figures as a dict."""
    latencies: list[float] = []
    # one shared HTTP client (as a real agent fleet would share a pool); connections up to the agents
    http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=min(agents, 256)))

    @rollout
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {task['i']}"}]
        for turn in range(turns):
            t0 = time.perf_counter()
            resp = await http.post(
                f"{llm.base_url}/chat/completions", json={"messages": messages, "max_tokens": 8}
            )
            latencies.append(time.perf_counter() - t0)
            resp.raise_for_status()
            messages.append(resp.json()["choices"][0]["message"])
            messages.append({"role": "user", "content": f"turn {turn + 1}"})
        return 1.0

    store = SQLiteStore(db, synchronous="NORMAL")
    engine = EchoEngine(tokenizer, reply=lambda ids, sp: "ok, next")
    async with running_proxy(engine, store, ledger_sweep_s=0.5) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource()}))
        gc.collect()
        rss_start = rss_mb()
        ids = [(await store.enqueue_rollout({"i": i})).rollout_id for i in range(agents)]
        start = time.perf_counter()
        stats = await Runner(agent, store, concurrency=agents, poll_interval=0.01).run(max_rollouts=agents)
        wall = time.perf_counter() - start
        ledger_at_end = len(proxy.ledger)
        with anyio.fail_after(30):  # the sweeper releases the finished attempts' ledgers
            while len(proxy.ledger):
                await anyio.sleep(0.1)
        gc.collect()
        rss_end = rss_mb()
        done = await store.wait_for_rollouts(ids, timeout=0)
    await http.aclose()
    await store.close()
    latencies.sort()
    n = len(latencies)
    return {
        "agents": agents,
        "turns": turns,
        "requests": n,
        "succeeded": sum(r.status is RolloutStatus.SUCCEEDED for r in done),
        "lost_rollouts": agents - sum(r.status is RolloutStatus.SUCCEEDED for r in done),
        "runner_succeeded": stats.succeeded,
        "p50_ms": round(latencies[n // 2] * 1000, 1),
        "p99_ms": round(latencies[min(n - 1, int(n * 0.99))] * 1000, 1),
        "wall_s": round(wall, 2),
        "requests_per_s": round(n / wall, 1),
        "rss_start_mb": round(rss_start, 1),
        "rss_end_mb": round(rss_end, 1),
        "rss_growth_kb_per_rollout": round((rss_end - rss_start) * 1024 / agents, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "ledger_conversations_at_end": ledger_at_end,
        "ledger_conversations_after_sweep": len(proxy.ledger),
    }
