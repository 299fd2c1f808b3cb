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
from collections.abc import Awaitable, Callable
from typing import Any

from trainer.distributed.placement import on_ray_thread
from trainer.fit.rollout_wait import deadline


class WorkerLoading:
    """``worker.ready`` under the ``trainer.timeouts.engine_s`` deadline, started now, awaited by ``wait``
    (any number of times; a load that failed raises each time). A worker without ``ready`` (in-process,
    already loaded) is ready at once. ``close`` cancels a load nobody waited for."""

    def __init__(self, worker: Any, seconds: float, what: str) -> None:
        self._task = self._begin(_given(worker), seconds, what)

    @classmethod
    def starting(cls, start: Callable[[], Any], seconds: float, what: str) -> WorkerLoading:
        """The worker that ``start`` creates, called on the Ray thread (``trainer.distributed.placement.on_ray_thread``:
        Ray itself may start there, for seconds, without holding the event loop), then loaded; the
        deadline covers both."""
        loading = cls.__new__(cls)
        loading._task = cls._begin(asyncio.wrap_future(on_ray_thread(start)), seconds, what)
        return loading

    @staticmethod
    def _begin(worker: Awaitable[Any], seconds: float, what: str) -> asyncio.Task[Any]:
        async def ready() -> Any:
            loaded = await worker
            if hasattr(loaded, "ready"):
                await loaded.ready.remote()
            return loaded

        return asyncio.ensure_future(deadline(ready(), seconds, what, "engine_s"))

    async def wait(self) -> Any:
        """The worker, once loaded."""
        return await asyncio.shield(self._task)  # a cancelled waiter leaves the load running for the next

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
        else:
            with contextlib.suppress(BaseException):
                self._task.exception()  # retrieved: no "exception was never retrieved" at exit


async def _given(worker: Any) -> Any:
    return worker
