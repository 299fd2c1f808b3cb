"""A client that closes its connection: ClientWatch sees it, the engine request is aborted, nothing recorded."""

from __future__ import annotations

import json
from typing import Any

import anyio

from agentloop.proxy.disconnect import ClientWatch
from agentloop.proxy.schemas import ChatCompletionRequest, parse_model
from agentloop.proxy.service import Target
from agentloop.store.memory import MemoryStore
from tests.proxy.conftest import attempt_url, both_loops, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

anyio_backend = both_loops  # asyncio's loop and uvloop's (tests/proxy/conftest.py)


async def test_client_watch_turns_gone_on_http_disconnect_and_its_block_ends_the_watch() -> None:
    inbox: list[dict[str, Any]] = []
    arrived = anyio.Event()

    async def receive() -> dict[str, Any]:  # an ASGI server's receive after the body was read
        await arrived.wait()
        return inbox.pop(0)

    with ClientWatch(receive) as watch:
        await anyio.sleep(0.01)
        assert not await watch.gone()
        inbox.append({"type": "http.disconnect"})
        arrived.set()
        await anyio.sleep(0.01)
        assert await watch.gone()

    blocked = anyio.Event()  # never set: the watch waits on receive until the block ends

    async def never() -> dict[str, Any]:
        await blocked.wait()
        raise AssertionError("unreachable")

    with ClientWatch(never) as watch:
        await anyio.sleep(0.01)
        task = watch._task
        assert task is not None and not task.done()
    await anyio.sleep(0.01)
    assert task.cancelled() and not await watch.gone()


async def test_a_client_that_closes_its_connection_mid_generation_is_aborted_and_not_recorded(
    tokenizer: Any,
) -> None:
    engine, store = EchoEngine(tokenizer, delay_s=10.0), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        path = attempt_url(proxy, att).removeprefix(proxy.url) + "/chat/completions"
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi."}]}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        with anyio.fail_after(10):
            sock = await anyio.connect_tcp("127.0.0.1", proxy.port)
            await sock.send(head.encode() + body)
            while not engine.calls:
                await anyio.sleep(0.01)
            await sock.aclose()  # the client leaves while the engine generates
            left_at = anyio.current_time()
            while not engine.aborted:
                await anyio.sleep(0.01)
            waited = anyio.current_time() - left_at
    assert waited < 2.0  # noticed within a poll or two (DISCONNECT_POLL_S), not at the generation's end
    assert engine.aborted[0].startswith(f"{att.rollout_id}/{att.attempt.attempt_id}/")
    assert await store.query_spans(att.rollout_id) == []


async def test_a_client_check_that_fails_leaves_the_generation_running(tokenizer: Any) -> None:
    engine, store = EchoEngine(tokenizer, delay_s=1.2), MemoryStore()  # two polls while generating
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        target = Target(att.rollout_id, att.attempt.attempt_id)
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi."}]}
        req = parse_model(ChatCompletionRequest, body, "chat completion request")
        asked = 0

        async def broken() -> bool:
            nonlocal asked
            asked += 1
            raise OSError("the connection's state cannot be read")

        with anyio.fail_after(10):
            gen = await proxy.service.chat(target, req, body["messages"], client_gone=broken)
    assert asked >= 3  # polled twice while generating, asked once more before recording
    assert gen.token_ids and engine.aborted == []
    assert len(await store.query_spans(att.rollout_id)) == 1  # answered and recorded
