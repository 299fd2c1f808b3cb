"""The trainer's hook: a step's finished rollouts, grouped by task, judged, scores written to the store.

Why the trainer calls it: the attempts at one task in one step are separate rollouts (``rollout.n``
copies, run by any runner in any order), so a relative judge can only score once the whole group has
finished. The succeeded rollouts are grouped by task (the same input, as GRPO's groups), each group is
sent to the judge in one request, and each attempt's score is written as a Reward span named
``judge.name`` (the store takes a late Reward span on a succeeded attempt: durable, shown by
``agentloop inspect``). An attempt's reward is the sum of its Reward spans, so an agent that returns
None is rewarded by the judge alone, and one that returns a value adds it to the judge's score.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio

from agentloop.errors import JudgeError
from agentloop.judge.cache import Verdict
from agentloop.judge.prompt import trajectory_messages
from agentloop.logging import get_logger
from agentloop.resources import LLM
from agentloop.types import LLMCall, Reward, RolloutStatus, Span

if TYPE_CHECKING:
    from agentloop.store.base import Store

log = get_logger("agentloop.judge")

__all__ = ["judge_rollouts"]

_Member = tuple[Any, str, list[Span]]  # (task, attempt id, the attempt's spans)


class GroupJudge(Protocol):
    """What ``judge_rollouts`` needs of a judge: ``RewardJudge`` (``agentloop.judge.reward``, which
    imports this module) is one."""

    name: str  # the Reward span name the scores are written under
    concurrency: int  # groups judged at once
    on_failure: Literal["raise", "skip"]
    requests: int  # requests sent so far (retries included)

    async def judge(
        self,
        task: Any,
        trajectories: Sequence[Sequence[dict[str, Any]]],
        *,
        llm: LLM | None = None,
        version: Any = None,
    ) -> Verdict: ...


async def judge_rollouts(
    judge: GroupJudge,
    store: Store,
    rollout_ids: Sequence[str],
    *,
    llm: LLM | None = None,
    version: Any = None,
) -> dict[str, float]:
    """Judge the succeeded rollouts among ``rollout_ids`` in groups of the same task and add each
    latest attempt's score as a Reward span named ``judge.name``; returns ``judge/...`` metrics.

    An attempt with no LLM call, or one already judged under this name, is left out. A group the judge
    fails on raises JudgeError after every group was tried, unless ``judge.on_failure`` is ``skip``."""
    t0 = time.perf_counter()
    groups = await _groups(store, rollout_ids, judge.name)
    stats = {"groups": 0, "attempts": 0, "failed_groups": 0, "cached_groups": 0, "requests": 0}
    scores: list[float] = []
    errors: list[JudgeError] = []
    limiter = anyio.CapacityLimiter(judge.concurrency)
    requests_before = judge.requests

    async def one(members: list[_Member]) -> None:
        async with limiter:
            try:
                verdict = await judge.judge(
                    members[0][0], [trajectory_messages(s) for _, _, s in members], llm=llm, version=version
                )
            except JudgeError as exc:
                stats["failed_groups"] += 1
                errors.append(exc)
                log.warning("judge.group_failed", attempts=len(members), error=str(exc)[:500])
                return
        for (_, attempt_id, spans), value in zip(members, verdict.scores, strict=True):
            reward = Reward(value=value, name=judge.name)
            await store.add_span(Span(rollout_id=spans[0].rollout_id, attempt_id=attempt_id, payload=reward))
        stats["groups"] += 1
        stats["attempts"] += len(members)
        stats["cached_groups"] += verdict.cached
        scores.extend(verdict.scores)

    async with anyio.create_task_group() as tg:
        for members in groups:
            tg.start_soon(one, members)
    if errors and judge.on_failure == "raise":
        more = f" (and {len(errors) - 1} other groups failed)" if len(errors) > 1 else ""
        raise JudgeError(f"{errors[0]}{more}; judge_reward(on_failure='skip') leaves such groups unrewarded")
    stats["requests"] = judge.requests - requests_before
    metrics = {f"judge/{k}": float(v) for k, v in stats.items()}
    if scores:
        metrics["judge/score_mean"] = sum(scores) / len(scores)
    metrics["timing/judge_s"] = time.perf_counter() - t0
    return metrics


async def _groups(store: Store, rollout_ids: Sequence[str], name: str) -> list[list[_Member]]:
    """The latest attempts still to judge, grouped by task in the order their tasks first came."""
    groups: dict[str, list[_Member]] = {}
    for rid in rollout_ids:
        rollout = await store.get_rollout(rid)
        if rollout.status is not RolloutStatus.SUCCEEDED:
            continue
        spans = await store.query_spans(rid, "latest")
        calls = [s for s in spans if isinstance(s.payload, LLMCall)]
        done = any(isinstance(s.payload, Reward) and s.payload.name == name for s in spans)
        if calls and not done:
            key = json.dumps(rollout.input, sort_keys=True)
            groups.setdefault(key, []).append((rollout.input, calls[0].attempt_id, spans))
    return list(groups.values())
