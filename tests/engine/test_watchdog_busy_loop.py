"""The watchdog on a busy event loop: a request the engine answered while the loop could not run the
answer yet (a long tokenisation, training holding the CPU) is not reported lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from structlog.testing import capture_logs

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine


async def test_an_answer_queued_on_a_busy_loop_is_not_lost(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cpu", stall_warning_s=0.2)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        await engine.generate([1, 2, 3], sp)  # started and warm
        with capture_logs() as logs:
            task = asyncio.create_task(engine.generate([1, 2, 3, 4], sp))
            await asyncio.sleep(0)  # the request is registered and queued
            time.sleep(3.0)  # the loop is blocked: the engine answers, the watchdog looks every 0.1 s
            out = await task
        assert out.token_ids and len(out.token_ids) == 4
        assert engine.stats().get("lost", 0) == 0
        assert not [e for e in logs if e["event"] == "engine.request_lost"]
    finally:
        await engine.stop()
