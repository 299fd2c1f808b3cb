"""200 concurrent agents through one proxy: every call answered and recorded, none lost."""

from __future__ import annotations

import ssl
from typing import Any

import anyio
import httpx

from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, running_proxy
from tests.proxy.engines import EchoEngine

AGENTS = 200


async def test_200_concurrent_agents_all_finish(tokenizer: Any, oai: Any) -> None:
    engine, store = EchoEngine(tokenizer, delay_s=0.01), MemoryStore()
    for i in range(AGENTS):
        await store.enqueue_rollout({"i": i})
    attempts = [await store.dequeue_rollout(f"w{i}") for i in range(AGENTS)]
    finished: list[str] = []
    tls = ssl.create_default_context()  # one context for all clients (building one per client costs ~20 ms)
    async with running_proxy(engine, store) as proxy:

        async def agent(att: Any) -> None:  # each agent has its own client and connection, as in a real run
            client = oai(attempt_url(proxy, att), http_client=httpx.AsyncClient(verify=tls, timeout=30))
            messages: list[Any] = [{"role": "user", "content": f"task {att.input['i']}"}]
            for turn in range(2):
                r = await client.chat.completions.create(model="m", messages=messages, seed=turn)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "next"}]  # fmt: skip
            finished.append(att.rollout_id)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for att in attempts:
                    tg.start_soon(agent, att)
    assert sorted(finished) == sorted(a.rollout_id for a in attempts if a is not None)
    for att in attempts:
        assert att is not None
        calls: list[LLMCall] = [s.payload for s in await store.query_spans(att.rollout_id)]  # type: ignore[misc]
        assert len(calls) == 2 and calls[0].messages[0]["content"] == f"task {att.input['i']}"
        head = calls[0].prompt_ids + calls[0].response_ids
        assert calls[1].prompt_ids[: len(head)] == head and calls[1].ledger_break is None
    assert len(engine.calls) == 2 * AGENTS
