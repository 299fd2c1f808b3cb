"""The SQL agent rewarded by an LLM judge instead of its checker (``run.py --reward judge``).

``JudgedSQLAgent`` gives no reward itself; ``judged_run`` runs each task ``group`` times through the
real runner, proxy and engine, hands the attempts to ``RewardJudge.judge_rollouts`` (the hook the
trainer calls after each step: the scores become Reward spans) and then re-checks every attempt with
the checker (``same_result`` on the query read back from its recorded messages), so the two can be
compared attempt by attempt (``agreement``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import anyio

from agentloop.errors import JudgeError
from agentloop.judge import RewardJudge, trajectory_messages
from agentloop.proxy.server import Proxy
from agentloop.resources import LLM, Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.types import Reward
from examples.sql_agent.agent import _FENCED, SYSTEM_PROMPT, SQLAgent, make_tools, same_result

__all__ = [
    "RUBRIC",
    "JudgedSQLAgent",
    "agreement",
    "judged_run",
    "make_judge",
    "recorded_query",
    "scripted_trajectory",
    "task_text",
]

RUBRIC = """\
- The trajectory that runs a SQL query whose result answers the question (the same rows the reference \
query returns) scores 1; a query that returns other rows, fails, or no query at all scores 0.
- Between two right answers, the one with fewer wasted steps scores a little higher; between two wrong \
ones, the one closer to the right query scores a little higher."""


def task_text(task: dict[str, Any]) -> str:
    """What the judge sees of a task: the question and the reference query (a reference-guided judge)."""
    return f"{task['question']}\nReference SQL (returns the right rows): {task['gold_sql']}"


def make_judge(llm: LLM | None = None, **options: Any) -> RewardJudge:
    """The SQL rubric's judge; ``llm=None`` judges with the served model."""
    options.setdefault("task_text", task_text)
    options.setdefault("max_chars", 1500)  # 4-6 trajectories of SmolLM2's 8k context
    return RewardJudge(RUBRIC, llm, **options)


class JudgedSQLAgent(SQLAgent):
    """The SQL agent without a reward of its own: the judge scores the attempts at a task together."""

    async def reward(self, task: dict[str, Any], final_state: Any) -> None:  # type: ignore[override]
        return None


def recorded_query(messages: Sequence[dict[str, Any]]) -> str | None:
    """The agent's answer query read from its recorded conversation, as ``agent_query`` reads the
    graph's state: its last run_query call, else a ```sql block in its last message."""
    for m in reversed(messages):
        for call in reversed(m.get("tool_calls") or []):
            fn = call.get("function", {})
            if fn.get("name") == "run_query":
                try:
                    query = json.loads(fn.get("arguments") or "{}").get("query")
                except (ValueError, AttributeError):
                    continue
                if isinstance(query, str):
                    return query
    if messages and messages[-1].get("role") == "assistant":
        fenced = _FENCED.findall(str(messages[-1].get("content") or ""))
        if fenced:
            return str(fenced[-1]).strip()
    return None


def scripted_trajectory(db: Path, task: dict[str, Any], query: str) -> list[dict[str, Any]]:
    """A conversation shaped like the agent's recorded ones that answers ``task`` with ``query`` (the
    gold query: a right attempt; another question's: a wrong one), its tool results really computed."""
    tools = {t.name: t for t in make_tools(db)}
    call = [{"id": "call_1", "type": "function", "function": {"name": "list_tables", "arguments": "{}"}}]
    run = [{"id": "call_2", "type": "function",
            "function": {"name": "run_query", "arguments": json.dumps({"query": query})}}]  # fmt: skip
    rows = str(tools["run_query"].invoke({"query": query}))
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "tool_call_id": "call_1", "content": str(tools["list_tables"].invoke({}))},
        {"role": "assistant", "content": "", "tool_calls": run},
        {"role": "tool", "tool_call_id": "call_2", "content": rows},
        {"role": "assistant", "content": f"The answer is:\n{rows}"},
    ]


async def judged_run(
    db: Path,
    tasks: Sequence[dict[str, Any]],
    engine: Any,
    judge: RewardJudge,
    *,
    group: int = 4,
    concurrency: int = 4,
    sampling: dict[str, Any] | None = None,
    wrong_queries: Sequence[str] | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Each task ``group`` times through ``JudgedSQLAgent``, then judged (the served model unless the
    judge has its own llm) and checked; one row per attempt: task index, judge score, checker score.

    Without ``wrong_queries`` the attempts are judged by ``judge.judge_rollouts`` (the trainer's hook:
    Reward spans). With them (one per task), each task's group also holds two scripted attempts, one
    answering with the gold query and one with ``wrong_queries[i]``, so every group holds attempts the
    checker tells apart; those groups are judged with ``judge.judge``."""
    store = MemoryStore()
    agent = JudgedSQLAgent(db)
    verdicts: list[Any] = []
    await engine.start()
    try:
        async with Proxy(engine, store, record_sessions=False) as proxy:
            llm = proxy.as_resource("agentloop", dict(sampling or {}))
            await store.add_resources(Resources(items={"llm": llm}))
            ids = [(await store.enqueue_rollout(t)).rollout_id for t in tasks for _ in range(group)]
            with anyio.fail_after(timeout_s):
                await Runner(agent, store, concurrency=concurrency, poll_interval=0.05).run(
                    max_rollouts=len(ids)
                )
                served = LLM(base_url=proxy.session_base_url, model=proxy.model_name, api_key=llm.api_key)
                if wrong_queries is None:
                    metrics = await judge.judge_rollouts(store, ids, llm=served)
                else:
                    metrics = {}
                    verdicts = [None] * len(tasks)
                    limiter = anyio.CapacityLimiter(judge.concurrency)  # the engine batches them

                    async def one(i: int, task: dict[str, Any]) -> None:
                        convs = [
                            trajectory_messages(await store.query_spans(r))
                            for r in ids[i * group : (i + 1) * group]
                        ]
                        convs += [
                            scripted_trajectory(db, task, task["gold_sql"]),
                            scripted_trajectory(db, task, wrong_queries[i]),
                        ]
                        async with limiter:
                            try:
                                verdicts[i] = await judge.judge(task, convs, llm=served)
                            except JudgeError as exc:
                                verdicts[i] = exc

                    async with anyio.create_task_group() as tg:
                        for i, task in enumerate(tasks):
                            tg.start_soon(one, i, task)
    finally:
        await engine.stop()
    rows = []
    for i, task in enumerate(tasks):
        convs, sources = [], []
        for rid in ids[i * group : (i + 1) * group]:
            spans = await store.query_spans(rid)
            judged = [
                s.payload.value
                for s in spans
                if isinstance(s.payload, Reward) and s.payload.name == judge.name
            ]
            convs.append((trajectory_messages(spans), judged[0] if judged else None))
            sources.append("model")
        if wrong_queries is not None:
            convs += [
                (scripted_trajectory(db, task, task["gold_sql"]), None),
                (scripted_trajectory(db, task, wrong_queries[i]), None),
            ]
            sources += ["scripted_right", "scripted_wrong"]
            verdict = verdicts[i]
            scores = verdict.scores if not isinstance(verdict, JudgeError) else [None] * len(convs)
            convs = [(m, score) for (m, _), score in zip(convs, scores, strict=True)]
        for (messages, score), source in zip(convs, sources, strict=True):
            query = recorded_query(messages)
            checked = await anyio.to_thread.run_sync(same_result, db, query, task["gold_sql"])
            rows.append(
                {"task": i, "source": source, "judge": score, "checker": float(checked), "query": query}
            )
    failures = [str(v) for v in verdicts if isinstance(v, JudgeError)]
    return {"metrics": metrics, "attempts": rows, "judge_failures": failures, "agreement": agreement(rows)}


def agreement(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How well judge scores match checker verdicts, over the attempts the judge scored:

    - ``pairwise``: over pairs of attempts at one task that the checker tells apart, the share the
      judge orders the same way (a tie counts half): what GRPO's relative advantages depend on;
    - ``accuracy_at_0.5``: the judge's score >= 0.5 read as "right", against the checker;
    - ``pearson``: the correlation of judge scores and checker verdicts (None when either is constant).
    """
    scored = [r for r in rows if r.get("judge") is not None]
    pairs = agree = 0.0
    by_task: dict[Any, list[dict[str, Any]]] = {}
    for r in scored:
        by_task.setdefault(r["task"], []).append(r)
    for members in by_task.values():
        for a, b in combinations(members, 2):
            if a["checker"] == b["checker"]:
                continue
            right, wrong = (a, b) if a["checker"] > b["checker"] else (b, a)
            pairs += 1
            agree += (
                1.0 if right["judge"] > wrong["judge"] else 0.5 if right["judge"] == wrong["judge"] else 0.0
            )
    judge_scores = [float(r["judge"]) for r in scored]
    checks = [float(r["checker"]) for r in scored]
    pearson = None
    if len(scored) > 1 and len(set(judge_scores)) > 1 and len(set(checks)) > 1:
        pearson = statistics.correlation(judge_scores, checks)
    return {
        "attempts": len(rows),
        "attempts_judged": len(scored),
        "checker_right": int(sum(r["checker"] for r in rows)),
        "judge_mean": statistics.fmean(judge_scores) if scored else None,
        "pairwise_pairs": int(pairs),
        "pairwise": agree / pairs if pairs else None,
        "accuracy_at_0.5": (
            statistics.fmean(
                float((j >= 0.5) == (c >= 1.0)) for j, c in zip(judge_scores, checks, strict=True)
            )
            if scored
            else None
        ),
        "pearson": pearson,
    }
