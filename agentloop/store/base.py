"""The Store protocol: the one async interface every backend (memory, SQLite, HTTP) implements.

Semantics shared by every backend (the state machine lives in :mod:`agentloop.store.state`):

- ``enqueue_rollout`` puts a rollout at the back of a FIFO queue.
- ``dequeue_rollout`` pops the front rollout and creates attempt n+1 (status preparing); the
  rollout records the latest resources version. Requeued rollouts go to the back of the queue.
- ``add_span`` assigns the next per-attempt sequence number when the span has none; the first span
  moves the attempt to running and every span counts as a heartbeat. Spans from an attempt that is
  not the latest one, or that already finished, raise ``StaleAttemptError``; the one exception is a
  Reward span for the latest attempt of a succeeded rollout (a late score: an LLM judge's).
- ``update_attempt`` with a terminal status propagates to the rollout: succeeded -> succeeded; a
  status in ``retry_on`` with attempts left -> requeued (back of the queue); otherwise failed.
- A watchdog (``check_timeouts``, also run on every dequeue) marks attempts timeout (older than
  ``timeout_s``) and unresponsive (no heartbeat for ``unresponsive_s``).
- Unknown ids raise ``NotFoundError`` naming the id.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import anyio

from agentloop.resources import Resources, ResourcesLike
from agentloop.types import (
    JSON,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ErrorInfo,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
)


@runtime_checkable
class Store(Protocol):
    """Async store of rollouts, attempts, spans and resources."""

    async def enqueue_rollout(
        self,
        input: JSON,
        mode: RolloutMode = "train",
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout: ...

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None: ...

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | None = None,
        error: ErrorInfo | None = None,
        heartbeat: bool = False,
    ) -> Attempt: ...

    async def add_span(self, span: Span) -> Span: ...

    async def query_spans(
        self, rollout_id: str, attempt_id: str | Literal["latest"] = "latest"
    ) -> list[Span]: ...

    async def get_rollout(self, rollout_id: str) -> Rollout: ...

    async def get_attempt(self, rollout_id: str, attempt_id: str) -> Attempt: ...

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> tuple[Rollout, Attempt]:
        """The rollout and one of its attempts, read together: one store call where the proxy's
        liveness check made two (``get_rollout`` + ``get_attempt``) per LLM call."""
        ...

    async def list_attempts(self, rollout_id: str) -> list[Attempt]: ...

    async def list_rollouts(
        self, status: list[str] | None = None, limit: int | None = None
    ) -> list[Rollout]: ...

    async def cancel_rollout(self, rollout_id: str) -> Rollout: ...

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float) -> list[Rollout]: ...

    async def add_resources(self, resources: ResourcesLike) -> int: ...

    async def get_latest_resources(self) -> Resources | None: ...

    async def get_resources(self, version: int) -> Resources: ...

    async def check_timeouts(self) -> list[Attempt]: ...

    async def close(self) -> None: ...


class RolloutWaiter:
    """One ``wait_for_rollouts`` call: the ids still pending and an event set when none are."""

    __slots__ = ("event", "pending")

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending
        self.event = anyio.Event()
