"""Futures as the Tinker SDK polls them: a submission answers ``{"request_id"}`` at once, the work
runs in the background, and ``/api/v1/retrieve_future`` returns its result when done.

The SDK polls again as soon as it hears "try again" (no sleep of its own), so ``retrieve`` waits up
to ``wait_s`` for the work before answering ``{"type": "try_again"}``: a long poll, one request per
``wait_s`` per pending future instead of a busy loop. Results stay ``keep_s`` after they finish (a
retry of a lost answer finds them), then go.

Lifecycle of one future (``FutureState``): PENDING -> DONE (a JSON dict or protobuf bytes) or
FAILED (a message and a category: ``user`` for a request the server cannot serve, ``server`` for a
fault of ours).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agentloop.logging import get_logger

__all__ = ["FutureState", "FutureTable", "Outcome"]

log = get_logger(__name__)

Outcome = dict[str, Any] | bytes


class FutureState(StrEnum):
    PENDING = "pending"  # submitted; the work runs or waits its turn
    DONE = "done"  # terminal: ``result`` holds the answer
    FAILED = "failed"  # terminal: ``error`` and ``category`` say why


@dataclass
class _Entry:
    state: FutureState = FutureState.PENDING
    result: Outcome | None = None
    error: str = ""
    category: str = "unknown"
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    done_at: float = 0.0


class FutureTable:
    """The server's futures (module docstring). ``user_errors``: exception types whose message is
    the caller's to fix (category ``user``); anything else is ``server`` and logged."""

    def __init__(
        self,
        user_errors: tuple[type[BaseException], ...] = (ValueError,),
        wait_s: float = 30.0,
        keep_s: float = 600.0,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.user_errors, self.wait_s, self.keep_s = user_errors, wait_s, keep_s

    def submit(self, work: Callable[[], Awaitable[Outcome]], what: str) -> str:
        """Start ``work`` now (tasks start in submission order) and return its request id."""
        self._purge()
        rid = f"{what}-{uuid.uuid4().hex[:16]}"
        entry = self._entries[rid] = _Entry()
        task = asyncio.get_running_loop().create_task(self._run(entry, work, rid), name=f"tinker-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return rid

    async def _run(self, entry: _Entry, work: Callable[[], Awaitable[Outcome]], rid: str) -> None:
        try:
            entry.result = await work()
            entry.state = FutureState.DONE
        except self.user_errors as exc:
            entry.state, entry.error, entry.category = FutureState.FAILED, str(exc), "user"
        except asyncio.CancelledError:
            entry.state, entry.error, entry.category = FutureState.FAILED, "cancelled", "server"
            raise
        except Exception as exc:  # a fault of ours: the client gets the message, the log the trace
            log.exception("tinker_request_failed", request_id=rid)
            entry.state, entry.error, entry.category = (
                FutureState.FAILED,
                f"{type(exc).__name__}: {exc}",
                "server",
            )
        finally:
            entry.done_at = time.monotonic()
            entry.finished.set()

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    async def retrieve(self, rid: str, wait_s: float | None = None) -> _Entry:
        """The entry of ``rid`` once finished, or still PENDING after ``wait_s``; KeyError if unknown."""
        entry = self._entries[rid]
        if entry.state is FutureState.PENDING:
            try:
                await asyncio.wait_for(entry.finished.wait(), self.wait_s if wait_s is None else wait_s)
            except TimeoutError:
                pass
        return entry

    def cancel(self, rid: str) -> bool:
        """Stop ``rid``'s work if it still runs; True when there was such a future."""
        for task in self._tasks:
            if task.get_name() == f"tinker-{rid}":
                task.cancel()
                return True
        return rid in self._entries

    def _purge(self) -> None:
        now = time.monotonic()
        old = [
            k
            for k, e in self._entries.items()
            if e.state is not FutureState.PENDING and now - e.done_at > self.keep_s
        ]
        for k in old:
            del self._entries[k]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
