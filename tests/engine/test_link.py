"""The engine link: a RemoteEngine in one place answers as the host's engine does, errors included."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.link import MAX_FRAME_BYTES, EngineHost, RemoteEngine
from agentloop.errors import ContextLengthExceededError, EngineError, RequestAbortedError
from tests.proxy.engines import EchoEngine

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, seed=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def linked(tokenizer: Any) -> AsyncIterator[tuple[EchoEngine, EngineHost, RemoteEngine]]:
    engine = EchoEngine(tokenizer)
    host = EngineHost(engine)
    path = await host.start()
    remote = RemoteEngine(path, tokenizer, engine.max_context)
    await remote.start()
    try:
        yield engine, host, remote
    finally:
        await remote.stop()
        await host.stop()


async def test_generate_returns_the_host_engines_answer(linked: Any) -> None:
    engine, _, remote = linked
    with anyio.fail_after(10):
        outs = await asyncio.gather(
            *(remote.generate([1, 2, 3 + i], SAMPLING, request_id=f"r{i}") for i in range(8))
        )
    assert [c.prompt_ids for c in engine.calls] == [[1, 2, 3 + i] for i in range(8)]
    assert [o for o in outs] == [c.output for c in engine.calls]  # the same TokenOutput, field by field
    assert remote.weights_version == engine.weights_version
    assert remote.max_context == engine.max_context and remote.tokenizer is engine.tokenizer


@pytest.mark.parametrize(
    ("fail_with", "raised"),
    [
        (ContextLengthExceededError("too long"), ContextLengthExceededError),
        (RequestAbortedError("aborted by an update"), RequestAbortedError),
        (EngineError("CUDA out of memory"), EngineError),
        (RuntimeError("something else"), EngineError),
    ],
)
async def test_the_engines_errors_come_back_as_their_own_types(
    linked: Any, fail_with: BaseException, raised: type[Exception]
) -> None:
    engine, _, remote = linked
    engine.fail_with = fail_with
    with anyio.fail_after(10), pytest.raises(raised, match=str(fail_with)):
        await remote.generate([1, 2, 3], SAMPLING)
    assert type(remote).__name__ == "RemoteEngine"  # and the link still works after it
    engine.fail_with = None
    assert (await remote.generate([1, 2, 3], SAMPLING)).token_ids


async def test_cancelling_a_call_aborts_it_in_the_host_engine(linked: Any) -> None:
    engine, _, remote = linked
    engine.delay_s = 5.0
    task = asyncio.ensure_future(remote.generate([1, 2], SAMPLING, request_id="slow"))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with anyio.fail_after(5):
        while "slow" not in engine.aborted:
            await asyncio.sleep(0.01)


async def test_a_closed_connection_aborts_its_calls_and_fails_the_client(tokenizer: Any) -> None:
    engine = EchoEngine(tokenizer, delay_s=5.0)
    host = EngineHost(engine)
    remote = RemoteEngine(await host.start(), tokenizer, engine.max_context)
    try:
        calls = [
            asyncio.ensure_future(remote.generate([1, 2], SAMPLING, request_id=f"c{i}")) for i in range(3)
        ]
        await asyncio.sleep(0.2)
        await host.stop()  # the engine's process going away
        with anyio.fail_after(5):
            results = await asyncio.gather(*calls, return_exceptions=True)
            await remote.closed.wait()
        assert all(isinstance(r, EngineError) for r in results), results
        with pytest.raises(EngineError, match="gone"):
            await remote.generate([1, 2], SAMPLING)
    finally:
        await remote.stop()


async def _raw(path: Path, payload: bytes) -> Any:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    try:
        with anyio.fail_after(5):
            header = await reader.readexactly(4)
            return orjson.loads(await reader.readexactly(struct.unpack(">I", header)[0]))
    except asyncio.IncompleteReadError:
        return None  # the host closed the connection
    finally:
        writer.close()


def _frame(obj: Any) -> bytes:
    body = orjson.dumps(obj)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    "message",
    [
        {"op": "generate", "id": 1, "prompt_ids": "not a list", "sampling": {}},
        {"op": "generate", "id": 1, "prompt_ids": [1, 2], "sampling": {"temperature": -1}},
        {"op": "generate", "id": 1, "prompt_ids": [1, 2], "sampling": {}, "request_id": 5},
        {"op": "shutdown", "id": 1},
        {"op": "abort", "id": 1},
        [1, 2, 3],
    ],
)
async def test_malformed_calls_are_answered_invalid_and_the_host_keeps_serving(
    linked: Any, message: Any
) -> None:
    _, host, remote = linked
    reply = await _raw(host.path, _frame(message))
    assert reply["err"]["kind"] == "invalid", reply
    assert (await remote.generate([1, 2, 3], SAMPLING)).token_ids


async def test_an_oversized_frame_closes_only_that_connection(linked: Any) -> None:
    _, host, remote = linked
    assert await _raw(host.path, struct.pack(">I", MAX_FRAME_BYTES + 1)) is None
    assert await _raw(host.path, b"\x00\x00\x00\x03{x}") is None  # not JSON
    assert (await remote.generate([1, 2, 3], SAMPLING)).token_ids


async def test_the_socket_folder_is_private(linked: Any) -> None:
    _, host, _ = linked
    assert host.path.parent.stat().st_mode & 0o077 == 0


async def test_a_worker_gone_mid_call_frees_its_requests_in_the_engine(linked: Any, tokenizer: Any) -> None:
    engine, host, remote = linked
    engine.delay_s = 5.0
    other = RemoteEngine(host.path, tokenizer, engine.max_context)  # a second worker's connection
    calls = [asyncio.ensure_future(other.generate([1, 2], SAMPLING, request_id=f"w{i}")) for i in range(3)]
    await asyncio.sleep(0.2)
    assert other._writer is not None
    other._writer.transport.abort()  # the worker process dies: its socket closes without a goodbye
    with anyio.fail_after(5):
        while sorted(engine.aborted) != ["w0", "w1", "w2"]:
            await asyncio.sleep(0.01)
    await asyncio.gather(*calls, return_exceptions=True)
    engine.delay_s = 0.0
    assert (await remote.generate([1, 2, 3], SAMPLING)).token_ids  # the other connection is untouched
