"""TorchEngine captures the other batch buckets' decode graphs while idle (_decode.capture_missing).

A capture between two steps holds every running request; with the idle capture, a burst whose size
differs from the first one's replays a graph instead. CUDA graphs need a GPU: the engine tests run
there too (AGENTLOOP_TEST_DEVICE=cuda); on a CPU only the bucket arithmetic is checked.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from agentloop.engine._decode import _batch_buckets, _pow2_at_least
from agentloop.engine._engine_thread import IDLE_CAPTURE_AFTER_S
from agentloop.engine.base import SamplingParams
from agentloop.engine.torch_engine import TorchEngine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("max_batch", [1, 2, 3, 48, 64, 256])
def test_batch_buckets_are_every_size_a_step_pads_to(max_batch: int) -> None:
    padded = {min(_pow2_at_least(n), max_batch) for n in range(1, max_batch + 1)}
    assert _batch_buckets(max_batch) == sorted(padded, reverse=True)


async def _burst(engine: TorchEngine, n: int, seed0: int) -> list[list[int]]:
    sp = [SamplingParams(max_tokens=6, temperature=1.0, seed=seed0 + i) for i in range(n)]
    outs = await asyncio.gather(*[engine.generate([1, 2, 3 + i % 7, 4], p) for i, p in enumerate(sp)])
    return [o.token_ids for o in outs]


async def _wait_idle_captures(engine: TorchEngine, want: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats()["idle_graph_captures"] < want:
        assert time.monotonic() < deadline, (
            f"idle captures: {engine.stats()['idle_graph_captures']} of {want}"
        )
        await asyncio.sleep(IDLE_CAPTURE_AFTER_S)


@needs_cuda
async def test_bursts_of_new_sizes_capture_nothing_after_the_idle_capture(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=64)
    lazy = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=64,
                       idle_graph_capture=False)  # fmt: skip
    try:
        first = await _burst(engine, 3, 0)  # batch bucket 4: one capture inside the steps
        assert engine.stats()["graph_captures"] == 1
        await _wait_idle_captures(engine, len(_batch_buckets(64)) - 1)  # 64, 32, 16, 8, 2, 1
        captured = engine.stats()["graph_captures"]
        later = [await _burst(engine, n, 100 * n) for n in (20, 50, 1)]
        assert engine.stats()["graph_captures"] == captured, "a burst captured a graph between its steps"
        assert engine.stats()["graph_replays"] > 0
        # the same tokens as an engine that captures each bucket when a step needs it
        assert first == await _burst(lazy, 3, 0)
        assert later == [await _burst(lazy, n, 100 * n) for n in (20, 50, 1)]
        assert lazy.stats()["idle_graph_captures"] == 0 and lazy.stats()["graph_captures"] == 4
    finally:
        await engine.stop()
        await lazy.stop()


@needs_cuda
async def test_a_request_arriving_during_idle_captures_is_served(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=256)
    try:
        await _burst(engine, 2, 0)
        await _wait_idle_captures(engine, 1)  # the idle captures have begun: 8 more remain
        outs = await asyncio.wait_for(_burst(engine, 5, 7), 30)
        assert [len(o) for o in outs] == [6] * 5
        await _wait_idle_captures(engine, len(_batch_buckets(256)) - 2)  # all but buckets 2 and 8
    finally:
        await engine.stop()


async def test_a_cpu_engine_has_no_idle_work(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cpu", dtype=torch.float32, max_batch_size=8)
    try:
        await _burst(engine, 3, 0)
        await asyncio.sleep(3 * IDLE_CAPTURE_AFTER_S)
        assert engine.stats()["idle_graph_captures"] == 0 and not engine.stats()["cuda_graphs"]
    finally:
        await engine.stop()
