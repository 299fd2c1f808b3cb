"""How a fit waits: for a call within its ``trainer.timeouts`` deadline, and for a step's rollouts."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio

from agentloop.agent_errors import user_location
from agentloop.errors import AgentLoopError, TrainerTimeoutError
from agentloop.store.base import Store

T = TypeVar("T")


async def deadline(call: Awaitable[T], seconds: float, what: str, key: str) -> T:
    """``await call``, or a TrainerTimeoutError naming ``what`` and the ``trainer.timeouts`` key."""
    try:
        with anyio.fail_after(seconds):
            return await call
    except TimeoutError:
        raise TrainerTimeoutError(
            f"gave up waiting {seconds:g} s for {what}; raise trainer.timeouts.{key} if it is only slow"
        ) from None


async def wait_all(
    store: Store, rollout_ids: list[str], idle_s: float, what: str, poll_s: float = 5.0
) -> list[Any]:
    """Wait until every rollout is terminal (the runner's watchdog and retries bound each attempt);
    a TrainerTimeoutError when none of them finishes for ``idle_s`` (no runner, or one that hangs)."""
    remaining = set(rollout_ids)
    done: dict[str, Any] = {}
    last_progress = time.monotonic()
    while remaining:
        wait = max(0.01, min(poll_s, idle_s - (time.monotonic() - last_progress)))
        for rollout in await store.wait_for_rollouts(sorted(remaining), timeout=wait):
            done[rollout.rollout_id] = rollout
            remaining.discard(rollout.rollout_id)
            last_progress = time.monotonic()
        if remaining:
            await store.check_timeouts()
            if time.monotonic() - last_progress >= idle_s:
                raise TrainerTimeoutError(
                    f"gave up waiting for the rollouts of {what}: {len(done)} of {len(rollout_ids)} finished, "
                    f"none in the last {idle_s:g} s; is a runner running (placement.local_runner, "
                    "`agentloop runner`)? raise trainer.timeouts.rollouts_s if they are only slow"
                )
    return [done[r] for r in rollout_ids]


async def failure_summary(store: Store, rollout_ids: list[str], limit: int = 5) -> str:
    """The distinct errors of the rollouts' failed attempts with their counts, most frequent first, each
    with where the user's code raised it (agentloop.agent_errors; ``agentloop inspect RUN --errors``
    shows the tracebacks): ``"12 x KeyError: 'answr' at agent.py:6 in score; 3 x Timeout: ..."``."""
    counts: Counter[str] = Counter()
    where: dict[str, str] = {}  # the first attempt's location for each kind of error
    for rid in rollout_ids:
        for attempt in await store.list_attempts(rid):
            if attempt.error is not None:
                first = (attempt.error.message or "").strip().splitlines()
                text = f"{attempt.error.type}: {first[0][:300]}" if first else attempt.error.type
                counts[text] += 1
                if text not in where and (at := user_location(attempt.error.traceback)) is not None:
                    where[text] = at
    if not counts:
        return "no attempt recorded an error"
    items = [
        f"{n} x {text}" + (f" at {where[text]}" if text in where else "")
        for text, n in counts.most_common(limit)
    ]
    more = len(counts) - limit
    return "; ".join(items) + (f"; and {more} other errors" if more > 0 else "")


async def cancel_quietly(store: Store, rollout_id: str) -> None:
    try:
        await store.cancel_rollout(rollout_id)
    except AgentLoopError:  # already finished
        pass
