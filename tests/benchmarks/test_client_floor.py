"""benchmarks/client_floor.py: the agents of engine_bench --via-proxy against a server that answers at once."""

from __future__ import annotations

import anyio
import httpx
import openai
import pytest

from tests.benchmarks import load_benchmark


@pytest.mark.e2e
async def test_the_floor_times_every_agent_of_each_round() -> None:
    bench = load_benchmark("client_floor")
    with anyio.fail_after(120):
        result = await bench.floor(agents=12, agent_procs=2, server_procs=1, reps=2)
    assert result["agents"] == 12 and len(result["rounds_ms"]) == 2
    med = result["median_ms"]
    # each round: the last send comes before the first answer is parsed, which comes before the round ends
    assert 0 <= med["last_send"] < med["first_received"] <= med["round"]
    assert all(r > 0 for r in result["rounds_ms"])


async def test_the_canned_server_answers_a_chat_completion() -> None:
    """The ASGI app reads the whole body and answers the canned completion the agents expect."""
    bench = load_benchmark("client_floor")
    transport = httpx.ASGITransport(app=bench.app)
    client = openai.AsyncOpenAI(
        base_url="http://floor/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )
    r = await client.chat.completions.create(model="agentloop", messages=[{"role": "user", "content": "hi"}])
    assert r.usage is not None and r.usage.completion_tokens == 128 and r.choices[0].finish_reason == "length"
    await client.close()
