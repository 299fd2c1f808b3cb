"""How long the event loop stalls while a test's code runs on it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


@asynccontextmanager
async def watch_event_loop(interval_s: float = 0.005, settle_s: float = 0.05) -> AsyncIterator[list[float]]:
    """Yields the list of gaps between the ticks of a coroutine that sleeps ``interval_s`` at a time
    while the block runs (a stalled loop shows as one long gap); after the block it keeps ticking
    ``settle_s`` more, so a stall right at the end shows up too."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(interval_s)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        try:
            yield gaps
            await anyio.sleep(settle_s)
        finally:
            tg.cancel_scope.cancel()
