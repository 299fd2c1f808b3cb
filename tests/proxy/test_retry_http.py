"""HTTP: an openai client that times out and retries leaves one recorded call."""

from __future__ import annotations

from typing import Any

import anyio
import openai
import pytest

from agentloop.engine.base import SamplingParams, TokenOutput
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

MESSAGES = [{"role": "user", "content": "Say something."}]


class SlowFirst(EchoEngine):
    """Takes 2 s on its first request (the client times out), answers at once after."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        self.delay_s = 2.0 if not self.calls else 0.0
        return await super().generate(prompt_ids, sampling, request_id)


@pytest.mark.parametrize("keyed", [False, True])
async def test_a_client_that_times_out_and_retries_leaves_one_recorded_call(
    tokenizer: Any, keyed: bool
) -> None:
    engine, store = SlowFirst(tokenizer), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = openai.AsyncOpenAI(base_url=attempt_url(proxy, att), api_key="x", timeout=1.0, max_retries=2)
        headers = {"Idempotency-Key": "call-1"} if keyed else {}
        with anyio.fail_after(30):
            resp = await client.chat.completions.create(model="m", messages=MESSAGES, extra_headers=headers)  # type: ignore[arg-type]
            await anyio.sleep(2.5)  # the first try would have finished by now
        await client.close()
    calls = [s.payload for s in await store.query_spans(att.rollout_id) if isinstance(s.payload, LLMCall)]
    assert len(calls) == 1, [c.response_message for c in calls]
    assert calls[0].response_message["content"] == resp.choices[0].message.content  # type: ignore[index]
    assert len(engine.calls) == (1 if keyed else 2)
