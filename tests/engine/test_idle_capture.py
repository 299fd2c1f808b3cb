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

from agentloop.engine.base import SamplingParams
from agentloop.engine.models import cache_argument
from agentloop.engine.torch._decode import ModelRunner, _batch_buckets, _pow2_at_least
from agentloop.engine.torch._engine_thread import IDLE_CAPTURE_AFTER_S
from agentloop.engine.torch._kv import SlotKVCache
from agentloop.engine.torch.engine import TorchEngine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("max_batch", [1, 2, 3, 48, 64, 256])
def test_batch_buckets_are_every_size_a_step_pads_to(max_batch: int) -> None:
    padded = {min(_pow2_at_least(n), max_batch) for n in range(1, max_batch + 1)}
    assert _batch_buckets(max_batch) == sorted(padded, reverse=True)


async def _burst(engine: TorchEngine, n: int, seed0: int) -> list[list[int]]:
    sp = [SamplingParams(max_tokens=6, temperature=1.0, seed=seed0 + i) for i in range(n)]
    outs = await asyncio.gather(*[engine.generate([1, 2, 3 + i % 7, 4], p) for i, p in enumerate(sp)])
    return [o.token_ids for o in outs]


async def _wait_stat(engine: TorchEngine, key: str, want: int, timeout_s: float = 60.0) -> None:
    """Until ``engine.stats()[key]`` (graph_captures, idle_graph_captures) reaches ``want``."""
    deadline = time.monotonic() + timeout_s
    while engine.stats()[key] < want:
        assert time.monotonic() < deadline, f"{key}: {engine.stats()[key]} of {want}"
        await asyncio.sleep(IDLE_CAPTURE_AFTER_S)


def test_missing_graphs_are_the_smaller_buckets_of_the_kinds_still_reachable(tiny_model_dir: Path) -> None:
    """Which graphs an idle engine would capture (the bookkeeping, on a CPU: no capture runs here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    cache = SlotKVCache.for_model(model, 64, 4096, torch.float32, torch.device("cpu"))
    cache.ensure_capacity(601)  # a capacity that is no power of two: it is the kv bucket while it lasts
    runner = ModelRunner(
        model, cache, cache_argument(model), 64, 4096, torch.device("cpu"), cuda_graphs=False
    )
    assert runner.missing_graphs() == []  # nothing captured yet: nothing to guess from
    for key in [(16, 601, "plain", False), (4, 256, "greedy", True)]:  # as two captures would leave it
        runner._graphs[key] = (None, torch.zeros(2, key[0]))
        runner._graph_kinds.add(key[1:])
    runner._largest_batch = 16  # the largest bucket a step used: no bigger one is guessed
    assert runner.missing_graphs() == [
        (16, 256, "greedy", True), (8, 256, "greedy", True), (2, 256, "greedy", True), (1, 256, "greedy", True),
        (8, 601, "plain", False), (4, 601, "plain", False), (2, 601, "plain", False), (1, 601, "plain", False),
    ]  # fmt: skip
    cache.ensure_capacity(1000)  # grown to 1202: the graphs go, and no step makes a 601 bucket again
    assert runner.missing_graphs() == [
        (16, 256, "greedy", True),
        *[(b, 256, "greedy", True) for b in (8, 4, 2, 1)],
    ]


@needs_cuda
async def test_bursts_of_new_sizes_capture_nothing_after_the_idle_capture(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=64)
    lazy = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=64,
                       idle_graph_capture=False)  # fmt: skip
    try:
        # batch bucket 64, captured inside the steps; so is a smaller one when a few requests joined a
        # step late and ran their last step alone
        first = await _burst(engine, 50, 0)
        in_step = engine.stats()["graph_captures"]
        assert in_step >= 1 and engine.stats()["idle_graph_captures"] == 0
        await _wait_stat(
            engine, "graph_captures", len(_batch_buckets(64))
        )  # the rest of 64, 32, 16, 8, 4, 2, 1 idle
        assert engine.stats()["idle_graph_captures"] == len(_batch_buckets(64)) - in_step
        captured = engine.stats()["graph_captures"]
        later = [await _burst(engine, n, 100 * n) for n in (20, 3, 1)]
        assert engine.stats()["graph_captures"] == captured, "a burst captured a graph between its steps"
        assert engine.stats()["graph_replays"] > 0
        # the same tokens as an engine that captures each bucket when a step needs it
        assert first == await _burst(lazy, 50, 0)
        assert later == [await _burst(lazy, n, 100 * n) for n in (20, 3, 1)]
        # the lazy engine captured 64, 32, 4 and 1 (and any straggler's bucket) inside its steps
        assert lazy.stats()["idle_graph_captures"] == 0 and lazy.stats()["graph_captures"] >= 4
    finally:
        await engine.stop()
        await lazy.stop()


@needs_cuda
async def test_a_request_arriving_during_idle_captures_is_served(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=256)
    try:
        await _burst(engine, 60, 0)  # bucket 64: the idle captures are 32, 16, 8, 4, 2, 1
        await _wait_stat(engine, "idle_graph_captures", 1)  # they have begun
        outs = await asyncio.wait_for(_burst(engine, 5, 7), 30)
        assert [len(o) for o in outs] == [6] * 5
        await _wait_stat(engine, "graph_captures", 7)  # 64 .. 1, each once, by a step or idle
        await asyncio.sleep(4 * IDLE_CAPTURE_AFTER_S)
        assert engine.stats()["graph_captures"] == 7  # no bucket above 64 is guessed
    finally:
        await engine.stop()


@needs_cuda
async def test_a_failed_idle_capture_keeps_the_graphs_already_captured(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph no step asked for that fails to capture stops the idle captures, not CUDA graphs."""
    engine = TorchEngine(tiny_model_dir, device="cuda", dtype=torch.float32, max_batch_size=64)
    try:
        first = await _burst(engine, 50, 0)  # bucket 64, captured inside a step
        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", _refuse)
        await _wait_stopped_idle_captures(engine)
        assert engine.stats()["cuda_graphs"] and engine.stats()["idle_graph_captures"] == 0
        monkeypatch.undo()
        replays = engine.stats()["graph_replays"]
        assert await _burst(engine, 50, 0) == first  # the 64-row graph replays, same tokens
        assert engine.stats()["graph_replays"] > replays
        await asyncio.sleep(4 * IDLE_CAPTURE_AFTER_S)
        assert engine.stats()["idle_graph_captures"] == 0, "the idle captures started again"
    finally:
        await engine.stop()


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("capture refused (test)")


async def _wait_stopped_idle_captures(engine: TorchEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine._runner.idle_capture:
        assert time.monotonic() < deadline, "the idle captures did not stop after a failed one"
        await asyncio.sleep(IDLE_CAPTURE_AFTER_S)


async def test_a_cpu_engine_has_no_idle_work(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, device="cpu", dtype=torch.float32, max_batch_size=8)
    try:
        await _burst(engine, 3, 0)
        await asyncio.sleep(3 * IDLE_CAPTURE_AFTER_S)
        assert engine.stats()["idle_graph_captures"] == 0 and not engine.stats()["cuda_graphs"]
    finally:
        await engine.stop()
