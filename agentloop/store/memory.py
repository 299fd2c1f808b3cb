"""MemoryStore: the in-process store (tests, single-process runs); nothing survives the process."""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import anyio

from agentloop.errors import NotFoundError
from agentloop.resources import Resources, ResourcesLike
from agentloop.store import state
from agentloop.store.base import RolloutWaiter
from agentloop.store.state import (
    parse_error,
    parse_ids,
    parse_limit,
    parse_resources,
    parse_span,
    parse_statuses,
    parse_version,
)
from agentloop.types import (
    JSON,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ErrorInfo,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Span,
)


class MemoryStore:
    """A Store kept in dicts. ``clock`` (default ``time.time``) lets tests move time by hand."""

    def __init__(self, clock: state.Clock = time.time) -> None:
        self._clock = clock
        self._lock = anyio.Lock()
        self._rollouts: dict[str, Rollout] = {}
        self._attempts: dict[str, dict[str, Attempt]] = {}  # rollout_id -> attempt_id -> Attempt (in order)
        self._latest: dict[str, str] = {}  # rollout_id -> latest attempt_id
        self._spans: dict[str, list[Span]] = {}  # attempt_id -> spans in sequence order
        self._next_span: dict[str, int] = {}  # attempt_id -> next span sequence_id
        self._queue: dict[str, None] = {}  # an ordered set: FIFO of rollout ids
        self._resources: list[Resources] = []
        self._watched: dict[str, tuple[str, float]] = {}  # attempt_id -> (rollout_id, watchdog deadline)
        self._waiters: dict[str, list[RolloutWaiter]] = {}

    # ------------------------------------------------------------ internals

    def _rollout(self, rollout_id: Any) -> Rollout:
        state.require_id("rollout_id", rollout_id)
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFoundError(f"rollout {rollout_id!r} not found") from None

    def _attempt(self, rollout_id: str, attempt_id: Any) -> Attempt:
        state.require_id("attempt_id", attempt_id)
        try:
            return self._attempts[rollout_id][attempt_id]
        except KeyError:
            raise NotFoundError(f"attempt {attempt_id!r} of rollout {rollout_id!r} not found") from None

    def _save(self, rollout: Rollout, attempt: Attempt | None = None) -> None:
        """Store new versions; keep the queue, the watchdog index and the waiters in step."""
        rid = rollout.rollout_id
        self._rollouts[rid] = rollout
        if attempt is not None:
            self._attempts[rid][attempt.attempt_id] = attempt
            deadline = state.attempt_deadline(attempt, rollout.config)
            if deadline is None:
                self._watched.pop(attempt.attempt_id, None)
            else:
                self._watched[attempt.attempt_id] = (rid, deadline)
        if rollout.status is RolloutStatus.REQUEUED:
            self._queue[rid] = None  # the back of the queue
        elif rollout.status.is_terminal:
            self._queue.pop(rid, None)
            for waiter in self._waiters.pop(rid, ()):
                waiter.pending.discard(rid)
                if not waiter.pending:
                    waiter.event.set()

    def _check_timeouts(self) -> list[Attempt]:
        now = self._clock()
        ended = []
        for aid, (rid, deadline) in list(self._watched.items()):
            if deadline >= now:
                continue
            changed = state.run_watchdog(self._rollouts[rid], self._attempts[rid][aid], now)
            if changed is None:
                self._watched.pop(aid, None)
                continue
            self._save(*changed)
            ended.append(changed[1].model_copy())
        return ended

    # ------------------------------------------------------------ rollouts and attempts

    async def enqueue_rollout(
        self,
        input: JSON,
        mode: RolloutMode = "train",
        config: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        rollout = state.new_rollout(input, mode, config, metadata, self._clock())
        async with self._lock:
            self._rollouts[rollout.rollout_id] = rollout
            self._attempts[rollout.rollout_id] = {}
            self._queue[rollout.rollout_id] = None
        return rollout.model_copy()

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        if worker_id is not None:
            state.require_id("worker_id", worker_id)
        async with self._lock:
            if self._watched:
                self._check_timeouts()
            if not self._queue:
                return None
            rid = next(iter(self._queue))
            del self._queue[rid]
            resources = self._resources[-1] if self._resources else None
            rollout, attempt, attempted = state.start_attempt(
                self._rollouts[rid], worker_id, resources, self._clock()
            )
            self._latest[rid] = attempt.attempt_id
            self._spans[attempt.attempt_id] = []
            self._next_span[attempt.attempt_id] = 1
            self._save(rollout, attempt)
        return attempted

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | str | None = None,
        error: ErrorInfo | None = None,
        heartbeat: bool = False,
    ) -> Attempt:
        parsed, err = state.parse_attempt_status(status), parse_error(error)
        async with self._lock:
            rollout = self._rollout(rollout_id)
            attempt = self._attempt(rollout_id, attempt_id)
            now = self._clock()
            rollout, attempt = state.update_attempt(
                rollout, attempt, self._latest.get(rollout_id), parsed, err, bool(heartbeat), now
            )
            self._save(rollout, attempt)
        return attempt.model_copy()

    async def add_span(self, span: Span) -> Span:
        span = parse_span(span)
        async with self._lock:
            rollout = self._rollout(span.rollout_id)
            attempt = self._attempt(span.rollout_id, span.attempt_id)
            aid = attempt.attempt_id
            attempt, span = state.accept_span(
                rollout,
                attempt,
                self._latest.get(rollout.rollout_id),
                span,
                self._next_span[aid],
                self._clock(),
            )
            assert span.sequence_id is not None
            self._next_span[aid] = max(self._next_span[aid], span.sequence_id + 1)
            self._spans[aid].append(span)
            self._save(rollout, attempt)
        return span.model_copy()

    async def query_spans(
        self, rollout_id: str, attempt_id: str | Literal["latest"] = "latest"
    ) -> list[Span]:
        async with self._lock:
            self._rollout(rollout_id)
            if attempt_id == "latest":
                aid = self._latest.get(rollout_id)
                if aid is None:
                    return []
            else:
                aid = self._attempt(rollout_id, attempt_id).attempt_id
            return [s.model_copy() for s in self._spans[aid]]

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return self._rollout(rollout_id).model_copy()

    async def get_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        self._rollout(rollout_id)
        return self._attempt(rollout_id, attempt_id).model_copy()

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> tuple[Rollout, Attempt]:
        rollout = self._rollout(rollout_id)
        return rollout.model_copy(), self._attempt(rollout_id, attempt_id).model_copy()

    async def list_attempts(self, rollout_id: str) -> list[Attempt]:
        self._rollout(rollout_id)
        return [a.model_copy() for a in self._attempts[rollout_id].values()]

    async def list_rollouts(self, status: list[str] | None = None, limit: int | None = None) -> list[Rollout]:
        wanted, limit = parse_statuses(status), parse_limit(limit)
        out: list[Rollout] = []
        for rollout in self._rollouts.values():
            if limit is not None and len(out) >= limit:
                break
            if wanted is None or rollout.status in wanted:
                out.append(rollout.model_copy())
        return out

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        async with self._lock:
            rollout = self._rollout(rollout_id)
            latest = self._latest.get(rollout_id)
            attempt = self._attempts[rollout_id][latest] if latest else None
            rollout, attempt = state.cancel(rollout, attempt, self._clock())
            self._save(rollout, attempt)
        return rollout.model_copy()

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` that are finished (succeeded/failed/cancelled) once all
        are, or once ``timeout`` seconds passed (0: at once). Overdue attempts are ended meanwhile."""
        ids, timeout = parse_ids(rollout_ids), state.require_timeout(timeout)
        async with self._lock:
            pending = {rid for rid in ids if not self._rollout(rid).status.is_terminal}
            waiter = RolloutWaiter(pending)
            if pending and timeout > 0:
                for rid in pending:
                    self._waiters.setdefault(rid, []).append(waiter)
        try:
            deadline = time.monotonic() + timeout
            while waiter.pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                with anyio.move_on_after(min(remaining, self._next_watchdog_in())):
                    await waiter.event.wait()
                if waiter.pending and self._watched:
                    async with self._lock:
                        self._check_timeouts()
        finally:
            for rid in waiter.pending:
                waiters = self._waiters.get(rid)
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
        return [self._rollouts[rid].model_copy() for rid in ids if self._rollouts[rid].status.is_terminal]

    def _next_watchdog_in(self) -> float:
        if not self._watched:
            return math.inf
        soonest = min(deadline for _, deadline in self._watched.values())
        return max(soonest - self._clock(), 0.0) + 0.01

    async def check_timeouts(self) -> list[Attempt]:
        async with self._lock:
            return self._check_timeouts()

    # ------------------------------------------------------------ resources

    async def add_resources(self, resources: ResourcesLike) -> int:
        parsed = parse_resources(resources)
        async with self._lock:
            version = len(self._resources) + 1
            self._resources.append(parsed.model_copy(update={"version": version}, deep=True))
        return version

    async def get_latest_resources(self) -> Resources | None:
        return self._resources[-1].model_copy(deep=True) if self._resources else None

    async def get_resources(self, version: int) -> Resources:
        version = parse_version(version)
        if not 1 <= version <= len(self._resources):
            raise NotFoundError(
                f"resources version {version} not found; the store has 1..{len(self._resources)}"
            )
        return self._resources[version - 1].model_copy(deep=True)

    async def close(self) -> None:
        """Nothing to release; kept for the Store protocol."""
