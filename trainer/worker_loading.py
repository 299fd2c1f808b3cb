"""The trainer worker's model load, awaited only where the worker is first needed.

A Ray ``TrainerWorker`` loads its model in its own process (seconds on a CPU: imports, weights, the
optimizer). Nothing before the first update needs it: the engine, the proxy, the runner and validation
before training do not. So the fit starts rollouts at once and awaits the load before the first thing
that calls the worker (a resumed checkpoint, the first update, the final model): the first rollout comes
that much sooner (issue 46: the first rollout within 15 s of the command on 2 cores).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from trainer.rollout_wait import deadline


class WorkerLoading:
    """``worker.ready`` under the ``trainer.timeouts.engine_s`` deadline, started now, awaited by ``wait``
    (any number of times; a load that failed raises each time). A worker without ``ready`` (in-process,
    already loaded) is ready at once. ``close`` cancels a load nobody waited for."""

    def __init__(self, worker: Any, seconds: float, what: str) -> None:
        self._task: asyncio.Task[Any] = asyncio.ensure_future(self._load(worker, seconds, what))

    @staticmethod
    async def _load(worker: Any, seconds: float, what: str) -> Any:
        if hasattr(worker, "ready"):
            await deadline(worker.ready.remote(), seconds, what, "engine_s")
        return worker

    async def wait(self) -> Any:
        """The worker, once loaded."""
        return await asyncio.shield(self._task)  # a cancelled waiter leaves the load running for the next

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
        else:
            with contextlib.suppress(BaseException):
                self._task.exception()  # retrieved: no "exception was never retrieved" at exit
