"""TorchEngine.generate_many: a burst reaches the engine thread whole and is admitted in one prefill; its
answers stream back as they finish; bad requests fail alone; closing the stream aborts the rest. And
EngineReplica.generate_many hands a TorchEngine the burst whole."""

from __future__ import annotations

import asyncio
import queue
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.engine.replicas import EngineReplica
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import ContextLengthExceededError
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def quick_gil() -> Iterator[None]:
    """The GIL handed over every microsecond, as on a GPU engine (5 ms there is shortened): the engine
    thread then wakes as soon as a first request is queued, which split a burst sent one by one."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class _SpyInbox(queue.SimpleQueue):  # type: ignore[type-arg]
    """An engine inbox that records the size of every "add" command the engine thread is sent."""

    def __init__(self) -> None:
        self.adds: list[int] = []

    def put(self, item: tuple[str, Any], block: bool = True, timeout: float | None = None) -> None:
        if item[0] == "add":
            self.adds.append(len(item[1]))
        super().put(item, block, timeout)


def _spy_on(engine: TorchEngine) -> list[int]:
    """Give a not yet started engine a recording inbox; returns its list of "add" sizes."""
    assert engine._thread is None
    engine._inbox = _SpyInbox()
    return engine._inbox.adds


async def _drain(stream: Any) -> dict[str, TokenOutput | Exception]:
    return {rid: out async for rid, out in stream}


async def test_a_burst_is_admitted_in_one_prefill(tiny_model_dir: Path, quick_gil: None) -> None:
    engine = make_engine("torch", tiny_model_dir, max_batch_size=16)
    prompts = [[5, 6, 7, 8 + i] for i in range(12)]
    try:
        with anyio.fail_after(60):
            adds = _spy_on(engine)
            got = await _drain(engine.generate_many([(p, GREEDY, f"b-{i}") for i, p in enumerate(prompts)]))
            stats = engine.stats()
            # the same requests one by one give the same tokens (greedy, batch-invariant sampling)
            alone = [await engine.generate(p, GREEDY) for p in prompts[:3]]
    finally:
        await engine.stop()
    assert adds[0] == 12  # one command for the whole burst, then one per single generate
    assert stats["prefill_batches"] == 1 and stats["requests"] == 12
    assert stats["decode_steps"] == GREEDY.max_tokens - 1  # the first token comes from the prefill
    assert set(got) == {f"b-{i}" for i in range(12)}
    outs = [got[f"b-{i}"] for i in range(12)]
    assert all(isinstance(o, TokenOutput) and len(o.token_ids) == 5 for o in outs)
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[:3]]  # type: ignore[union-attr]


async def test_bad_requests_fail_alone(tiny_model_dir: Path) -> None:
    engine = make_engine("torch", tiny_model_dir, max_batch_size=8, max_context=64)
    burst: list[tuple[Any, Any, str]] = [
        ([5, 6, 7], GREEDY, "ok-0"),
        ([], GREEDY, "empty"),
        ([5, 10**9], GREEDY, "out-of-vocab"),
        ([5] * 80, GREEDY, "too-long"),
        ([5, 6], "not sampling", "bad-sampling"),
        ([5, 6, 8], GREEDY, "ok-0"),  # a request id twice in one burst
        ([5, 6, 9], GREEDY, "ok-1"),
    ]
    try:
        with anyio.fail_after(60):
            got = [answer async for answer in engine.generate_many(burst)]
    finally:
        await engine.stop()
    rids = [rid for rid, _ in got]
    assert rids[:5] == ["empty", "out-of-vocab", "too-long", "bad-sampling", "ok-0"]  # errors first
    errors = dict(got[:5])
    assert isinstance(errors["empty"], ValueError) and isinstance(errors["out-of-vocab"], ValueError)
    assert isinstance(errors["too-long"], ContextLengthExceededError)
    assert isinstance(errors["bad-sampling"], TypeError)
    assert "already in flight" in str(errors["ok-0"])  # the second "ok-0" of the burst
    answers = dict(got[5:])
    assert sorted(answers) == ["ok-0", "ok-1"]
    assert all(isinstance(o, TokenOutput) and len(o.token_ids) == 5 for o in answers.values())
    assert engine.stats()["requests"] == 2


async def test_closing_the_stream_aborts_what_still_runs(tiny_model_dir: Path) -> None:
    engine = make_engine("torch", tiny_model_dir, max_batch_size=8)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    burst = [([5, 6, 7], short, "short"), *[([5, 6, 8 + i], LONG, f"long-{i}") for i in range(3)]]
    try:
        with anyio.fail_after(60):
            stream = engine.generate_many(burst)
            first = await anext(stream)
            await stream.aclose()
            assert not engine._inflight  # at once, not when the generators are collected
            stats = await _settled(engine)
    finally:
        await engine.stop()
    assert first[0] == "short"
    assert stats["finished_abort"] == 3 and stats["generated_tokens"] < 3 * LONG.max_tokens


async def test_closing_while_errors_are_read_aborts_the_burst(tiny_model_dir: Path) -> None:
    """A burst is registered and sent before its first answer: while its consumer reads an error, a new
    call with one of its ids is refused, and closing there aborts the requests, started or not."""
    engine = make_engine("torch", tiny_model_dir, max_batch_size=8)
    burst = [([], GREEDY, "bad"), ([5, 6, 7], LONG, "a"), ([5, 6, 8], LONG, "b")]
    try:
        with anyio.fail_after(60):
            stream = engine.generate_many(burst)
            rid, error = await anext(stream)
            assert rid == "bad" and isinstance(error, ValueError)
            assert set(engine._inflight) == {"a", "b"}
            with pytest.raises(ValueError, match="already in flight"):
                await engine.generate([5, 6, 9], GREEDY, request_id="a")
            await stream.aclose()
            assert not engine._inflight
            stats = await _settled(engine)
    finally:
        await engine.stop()
    assert stats["finished_abort"] == 2 and stats["requests"] == 2


async def _settled(engine: TorchEngine) -> dict[str, Any]:
    """The engine's stats once nothing is running or waiting (aborts are commands it reads next step)."""
    while engine.stats()["running"] or engine.stats()["waiting"] or engine._inbox.qsize():
        await asyncio.sleep(0.005)
    return engine.stats()


async def test_a_replica_hands_its_torch_engine_the_burst_whole(tiny_model_dir: Path) -> None:
    replica = EngineReplica(str(tiny_model_dir), "cpu", {"max_batch_size": 8})
    try:
        with anyio.fail_after(60):
            adds = _spy_on(replica.engine)
            got = await _drain(replica.generate_many([([5, 6, 7 + i], GREEDY, f"r-{i}") for i in range(6)]))
            stream = replica.generate_many([([5, 6, 7], GREEDY, "first"), ([5, 6, 8], LONG, "long")])
            await anext(stream)
            await stream.aclose()  # closing the replica's stream closes the engine's: "long" is aborted now
            assert not replica.engine._inflight
            stats = await _settled(replica.engine)
    finally:
        await replica.stop()
    assert adds == [6, 2]
    assert len(got) == 6 and stats["finished_abort"] == 1
