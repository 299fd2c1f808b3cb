"""TorchEngine's engine-thread timers (stats()): where the thread's time went, nested as measured."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio

from agentloop.engine.base import SamplingParams
from tests.engine.conftest import make_engine


async def test_timers_nest_and_count_prefills_and_decodes(
    tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    engine = make_engine("torch", tiny_model_dir, max_batch_size=4)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    try:
        with anyio.fail_after(60):
            first = asyncio.ensure_future(engine.generate(chat_prompt, sampling))
            while engine.stats().get("generated_tokens", 0) < 2:
                await asyncio.sleep(0.002)
            await asyncio.gather(first, engine.generate([5, 6, 7, 8], sampling))  # admitted mid-decode
    finally:
        await engine.stop()
    s = engine.stats()
    assert s["prefill_batches"] == 2 and s["decode_steps"] >= 5
    # each timer is measured inside the one that encloses it, on one clock, so the sums cannot exceed it
    assert 0 < s["prefill_s"] <= s["schedule_s"]
    assert s["decode_s"] > 0 and s["update_s"] > 0
    assert s["schedule_s"] + s["decode_s"] + s["update_s"] <= s["step_s"]
    assert s["decode_ms_per_step"] == 1e3 * s["decode_s"] / s["decode_steps"]
