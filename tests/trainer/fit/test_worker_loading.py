"""The trainer worker's load is awaited where the worker is first needed (trainer/fit/worker_loading.py):
started at once, awaited any number of times, its failure raised to every waiter, its deadline named,
a load nobody waited for cancelled on close."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from agentloop.errors import TrainerTimeoutError
from trainer.fit.worker_loading import WorkerLoading


class Remote:
    def __init__(self, call: Any) -> None:
        self.remote = call


class Worker:
    """A Ray actor handle's shape: ``ready.remote()`` gives an awaitable (here a coroutine)."""

    def __init__(self, seconds: float, error: Exception | None = None) -> None:
        self.started = 0
        self.seconds, self.error = seconds, error

        async def ready() -> bool:
            self.started += 1
            await asyncio.sleep(self.seconds)
            if self.error is not None:
                raise self.error
            return True

        self.ready = Remote(ready)


async def test_the_load_starts_at_once_and_is_awaited_later() -> None:
    worker = Worker(0.05)
    loading = WorkerLoading(worker, 10, "the trainer worker to load m")
    await asyncio.sleep(0)
    assert worker.started == 1  # running before anyone waits: rollouts go on meanwhile
    assert await loading.wait() is worker
    assert await loading.wait() is worker  # a second wait returns at once
    assert worker.started == 1
    loading.close()


async def test_a_failed_load_raises_to_every_waiter() -> None:
    loading = WorkerLoading(Worker(0.0, RuntimeError("out of memory")), 10, "the trainer worker to load m")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="out of memory"):
            await loading.wait()
    loading.close()


async def test_the_deadline_names_the_wait_and_its_key() -> None:
    loading = WorkerLoading(Worker(5.0), 0.05, "the trainer worker to load m")
    with pytest.raises(
        TrainerTimeoutError, match=r"for the trainer worker to load m; raise trainer.timeouts.engine_s"
    ):
        await loading.wait()


async def test_a_cancelled_waiter_leaves_the_load_running_and_close_cancels_it() -> None:
    worker = Worker(0.2)
    loading = WorkerLoading(worker, 10, "w")
    waiter = asyncio.ensure_future(loading.wait())
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await loading.wait()  # the load itself was not cancelled with the waiter
    late = WorkerLoading(Worker(10.0), 60, "w")
    await asyncio.sleep(0)
    late.close()
    await asyncio.sleep(0)
    assert late._task.cancelled()


async def test_a_worker_without_ready_is_ready() -> None:
    plain = object()
    assert await WorkerLoading(plain, 1, "w").wait() is plain


async def test_starting_calls_start_on_the_ray_thread_then_loads() -> None:
    """``starting``: the worker is created on agentloop's Ray thread (where ray.init may block for
    seconds), not on the event loop's; its load follows; a failed start reaches every waiter."""
    worker = Worker(0.0)
    threads: list[str] = []

    def start() -> Worker:
        threads.append(threading.current_thread().name)
        return worker

    loading = WorkerLoading.starting(start, 10, "w")
    assert await loading.wait() is worker
    assert threads == ["agentloop-ray"] and worker.started == 1

    def broken() -> Worker:
        raise RuntimeError("ray did not start")

    failed = WorkerLoading.starting(broken, 10, "w")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="ray did not start"):
            await failed.wait()


async def test_the_deadline_covers_the_start() -> None:
    release = threading.Event()
    loading = WorkerLoading.starting(lambda: release.wait(5), 0.05, "the trainer worker to load m")
    try:
        with pytest.raises(TrainerTimeoutError, match="the trainer worker to load m"):
            await loading.wait()
    finally:
        release.set()
