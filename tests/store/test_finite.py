"""Finite numbers and bounded nesting only (issue 16): an ``Infinity`` reward used to be accepted,
stored as null, and every later read of its rollout raised (crashing the trainer and inspect); JSON
nested 256-1024 deep in a span's free-form field gave a 503 and lost the span. Now both are refused
up front, naming the field: ValueError in Python, 4xx over HTTP; the rollout stays readable."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agentloop.errors import InvalidRequestError
from agentloop.store.base import Store
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import (
    MAX_JSON_DEPTH,
    LLMCall,
    Log,
    Reward,
    RolloutConfig,
    ToolCall,
    Triplet,
)

BAD = [math.inf, -math.inf, math.nan]


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _makers(bad: float) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("value", lambda: Reward(value=bad)),
        ("response_logprobs", lambda: LLMCall(response_ids=[1, 2], response_logprobs=[-0.5, bad])),
        ("latency_s", lambda: LLMCall(latency_s=bad)),
        ("timeout_s", lambda: RolloutConfig(timeout_s=bad)),
        ("reward", lambda: Triplet(prompt_ids=[1], response_ids=[2], reward=bad)),
        ("response_logprobs", lambda: Triplet(prompt_ids=[1], response_ids=[2], response_logprobs=[bad])),
        ("sampling", lambda: LLMCall(sampling={"temperature": bad})),
        ("fields", lambda: Log(message="m", fields={"loss": [1.0, {"x": bad}]})),
        ("result", lambda: ToolCall(name="t", result=bad)),
    ]


@pytest.mark.parametrize("bad", BAD, ids=["inf", "-inf", "nan"])
def test_models_refuse_nan_and_infinity_naming_the_field(bad: float) -> None:
    for field, make in _makers(bad):
        with pytest.raises(ValidationError, match=field):
            make()
    reward = Reward(value=1.0)
    with pytest.raises(ValidationError, match="value"):
        reward.value = bad  # assignment is validated too


@pytest.mark.parametrize("bad", BAD, ids=["inf", "-inf", "nan"])
async def test_store_calls_refuse_non_finite_input_and_metadata(store: Store, bad: float) -> None:
    with pytest.raises((InvalidRequestError, ValidationError), match="input"):
        await store.enqueue_rollout({"x": bad})
    with pytest.raises((InvalidRequestError, ValidationError), match="metadata"):
        await store.enqueue_rollout({"x": 1}, metadata={"score": bad})
    with pytest.raises((InvalidRequestError, ValidationError), match="timeout_s"):
        await store.enqueue_rollout({"x": 1}, config={"timeout_s": bad})  # type: ignore[arg-type]
    assert await store.list_rollouts() == []


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 256, 1024, 5000])
async def test_deep_json_is_refused_naming_the_field(store: Store, depth: int) -> None:
    with pytest.raises(ValidationError, match=f"fields is nested deeper than {MAX_JSON_DEPTH}"):
        Log(message="m", fields={"x": nested(depth)})
    with pytest.raises(ValidationError, match="messages is nested deeper"):
        LLMCall(messages=[{"role": "user", "content": nested(depth)}])
    with pytest.raises((InvalidRequestError, ValidationError), match="input is nested deeper"):
        await store.enqueue_rollout(nested(depth))
    rollout = await store.enqueue_rollout(nested(MAX_JSON_DEPTH - 1))  # just inside: kept as sent
    assert (await store.get_rollout(rollout.rollout_id)).input == nested(MAX_JSON_DEPTH - 1)


# ---------------------------------------------------------------- over HTTP: 4xx, and the rollout stays readable


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store) as server, httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        yield client
    await store.close()


async def _attempt(http: httpx.AsyncClient) -> tuple[str, str]:
    rid = (await http.post("/v1/rollouts", json={"input": {"q": 1}})).json()["rollout_id"]
    aid = (await http.post("/v1/dequeue", json={})).json()["attempt"]["attempt_id"]
    return rid, aid


def _raw_span(rid: str, aid: str, payload: str) -> bytes:
    return f'{{"rollout_id": "{rid}", "attempt_id": "{aid}", "payload": {payload}}}'.encode()


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
async def test_a_non_finite_reward_or_logprob_is_422_and_the_rollout_stays_readable(
    http: httpx.AsyncClient, literal: str
) -> None:
    rid, aid = await _attempt(http)
    for payload, field in [
        (f'{{"kind": "reward", "value": {literal}}}', "payload.reward.value"),
        (
            f'{{"kind": "llm_call", "response_ids": [5], "response_logprobs": [{literal}]}}',
            "response_logprobs",
        ),
        (f'{{"kind": "log", "message": "m", "fields": {{"loss": {literal}}}}}', "fields"),
        (f'{{"kind": "tool_call", "name": "t", "arguments": {{"x": [{literal}]}}}}', "arguments"),
    ]:
        resp = await http.post("/v1/spans", content=_raw_span(rid, aid, payload))
        assert resp.status_code == 422, resp.text
        assert field in resp.json()["error"]["message"]
    bad_input = await http.post("/v1/rollouts", content=f'{{"input": {{"x": {literal}}}}}'.encode())
    assert bad_input.status_code == 422 and "input" in bad_input.json()["error"]["message"]
    ok = await http.post("/v1/spans", content=_raw_span(rid, aid, '{"kind": "reward", "value": 1.5}'))
    assert ok.status_code == 200
    spans = await http.get(f"/v1/rollouts/{rid}/spans")  # the read that used to fail for good
    assert spans.status_code == 200 and [s["payload"]["value"] for s in spans.json()] == [1.5]
    assert (await http.get(f"/v1/rollouts/{rid}")).status_code == 200


@pytest.mark.parametrize("depth", [150, 256, 512, 1024])
async def test_deep_json_in_a_span_is_4xx_never_5xx(http: httpx.AsyncClient, depth: int) -> None:
    rid, aid = await _attempt(http)
    deep = "[" * depth + "1" + "]" * depth
    for payload in (
        f'{{"kind": "log", "message": "m", "fields": {{"x": {deep}}}}}',
        f'{{"kind": "llm_call", "sampling": {{"extra": {deep}}}}}',
    ):
        resp = await http.post("/v1/spans", content=_raw_span(rid, aid, payload))
        assert 400 <= resp.status_code < 500, resp.text
    ok = await http.post("/v1/spans", content=_raw_span(rid, aid, '{"kind": "log", "message": "after"}'))
    assert ok.status_code == 200
    spans = (await http.get(f"/v1/rollouts/{rid}/spans")).json()
    assert [s["payload"]["message"] for s in spans] == ["after"]
