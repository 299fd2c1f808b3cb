"""TorchEngine's watchdog: slow requests are logged with their state; a request the engine no longer
holds is failed instead of leaving its caller waiting forever."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch._engine_thread import Request
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import EngineError


class BusyClock:
    """A fake monotonic clock for the engine: 0 s while it runs no request, ``busy_s`` while it runs one.
    ``generate()`` stamps a request at 0 s, so the watchdog's first look after the engine admits it
    finds it ``busy_s`` old and running, however fast the machine decodes."""

    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s
        self.engine: TorchEngine | None = None

    def __call__(self) -> float:
        return self.busy_s if self.engine is not None and self.engine._running else 0.0


async def test_a_slow_request_is_logged_with_its_state(tiny_model_dir: Path) -> None:
    clock = BusyClock(busy_s=60.0)
    engine = TorchEngine(tiny_model_dir, device="cpu", stall_warning_s=30.0, clock=clock)
    clock.engine = engine
    try:
        with capture_logs() as logs, anyio.fail_after(60):
            sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            out = await engine.generate([1, 2, 3, 4], sp)
        assert len(out.token_ids) == 8
        slow = [e for e in logs if e["event"] == "engine.slow_request"]
        assert len(slow) == 1, slow  # once per request
        assert slow[0]["state"] == "running" and slow[0]["max_tokens"] == 8
        assert slow[0]["age_s"] == 60.0 and slow[0]["generated"] >= 1
        assert engine.stats().get("lost", 0) == 0
    finally:
        await engine.stop()


async def test_a_request_the_engine_does_not_hold_is_failed(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cpu", stall_warning_s=0.5)
    await engine.start()
    try:
        loop = asyncio.get_running_loop()
        sp = SamplingParams(max_tokens=4)
        lost = Request(
            "lost-1", [1, 2], sp, loop.create_future(), loop, 0, frozenset(), added_at=time.monotonic()
        )
        engine._inflight["lost-1"] = lost  # registered by generate(), but never reached the engine
        with anyio.fail_after(10), pytest.raises(EngineError, match="lost track of request lost-1"):
            await lost.future
        assert engine.stats()["lost"] == 1
        with anyio.fail_after(30):  # the engine keeps serving
            assert len((await engine.generate([1, 2, 3], sp)).token_ids) == 4
    finally:
        engine._inflight.pop("lost-1", None)
        await engine.stop()


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(tiny_model_dir: Path) -> None:
    """A program stopped with requests in flight (its event loop closed, e.g. by a SIGTERM during
    validation) leaves answers nobody can take: the engine thread drops them and keeps serving, where it
    used to die of "Event loop is closed" and leave every later caller waiting."""
    engine = TorchEngine(tiny_model_dir, device="cpu")
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    gone = asyncio.new_event_loop()
    pending = gone.create_task(engine.generate([1, 2, 3, 4], sp))
    deadline = time.monotonic() + 30
    while not engine._inflight and time.monotonic() < deadline:
        gone.run_until_complete(asyncio.sleep(0.01))
    assert engine._inflight, "the request never reached the engine"
    thread, request = engine._thread, next(iter(engine._inflight.values()))
    gone.close()  # the answer comes back to a closed loop
    del pending
    while not request.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the answer handed on (or, before the fix, the thread dead)
    assert thread is not None and thread.is_alive()

    async def later() -> list[int]:
        out = await asyncio.wait_for(
            engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4)), 60
        )
        assert engine._thread is thread  # the same thread served it, not a restarted one
        await engine.stop()
        return out.token_ids

    assert len(asyncio.run(later())) == 4
