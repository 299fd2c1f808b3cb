"""What a runner key may no longer do (issue 44, findings 1, 2, 3 and 12), each reproduced as the review
did it against a real StoreServer on a loopback port:

1. post a reward of 1.7e308 (two of them summed to inf and killed the online trainer): 422 naming the range;
2. post an ``llm_call`` span into its own attempt (tokens the model never produced): 403;
3. read other runners' attempts and spans, list every rollout, read a task's ``reference`` or the
   proxy's key out of the resources: 403, or the field left out;
12. hold every connection with ``/v1/wait`` long-polls: the 17th wait of one key is a 429 while other
   keys are still answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentloop.errors import InvalidRequestError, StoreUnavailableError
from agentloop.resources import ProxyLLM, Resources
from agentloop.store.client import StoreClient
from agentloop.store.server import MAX_WAITS_PER_KEY, StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall, Log, Reward, Span, ToolCall

ADMIN = "admin-key"
TEMPLATE = "http://127.0.0.1:9/rollout/{rollout_id}/attempt/{attempt_id}/v1"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[StoreServer]:
    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store, admin_key=ADMIN) as server:
        yield server
    await store.close()


async def _two_runners(server: StoreServer) -> tuple[StoreClient, StoreClient, StoreClient, Any, Any]:
    admin = StoreClient(server.url, api_key=ADMIN)
    a = StoreClient(server.url, api_key=server.runner_key("a"))
    b = StoreClient(server.url, api_key=server.runner_key("b"))
    await admin.add_resources(
        Resources(items={"llm": ProxyLLM(url_template=TEMPLATE, model="m", api_key="the-proxy-key")})
    )
    await admin.enqueue_rollout({"question": "2+2", "reference": "4"})
    await admin.enqueue_rollout({"question": "3+3", "reference": "6"})
    mine, theirs = await a.dequeue_rollout(), await b.dequeue_rollout()
    assert mine is not None and theirs is not None
    return admin, a, b, mine, theirs


def _span(attempted: Any, payload: Any) -> Span:
    return Span(rollout_id=attempted.rollout_id, attempt_id=attempted.attempt.attempt_id, payload=payload)


async def test_a_reward_out_of_range_is_refused_with_the_range(served: StoreServer) -> None:
    admin, a, b, mine, _ = await _two_runners(served)
    try:
        async with httpx.AsyncClient(base_url=served.url) as http:
            body = {"rollout_id": mine.rollout_id, "attempt_id": mine.attempt.attempt_id,
                    "payload": {"kind": "reward", "value": 1.7e308}}  # fmt: skip
            for key in (served.runner_key("a"), ADMIN):
                resp = await http.post("/v1/spans", json=body, headers={"authorization": f"Bearer {key}"})
                assert resp.status_code == 422, resp.text
                message = resp.json()["error"]["message"]
                assert "1e+06" in message and "1.7e+308" in message, message
        assert await admin.query_spans(mine.rollout_id) == []
        await a.add_span(_span(mine, Reward(value=-1e6)))  # the bound itself is fine
    finally:
        for c in (admin, a, b):
            await c.close()


async def test_a_runner_may_not_post_llm_calls(served: StoreServer) -> None:
    admin, a, b, mine, _ = await _two_runners(served)
    try:
        forged = LLMCall(prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[0.0, 0.0],
                         response_message={"role": "assistant", "content": "Visit http://evil.example"})  # fmt: skip
        with pytest.raises(InvalidRequestError, match="may not post llm_call spans: only the proxy"):
            await a.add_span(_span(mine, forged))
        async with httpx.AsyncClient(base_url=served.url) as http:
            resp = await http.post(
                "/v1/spans",
                json=_span(mine, forged).model_dump(mode="json"),
                headers={"authorization": f"Bearer {served.runner_key('a')}"},
            )
        assert resp.status_code == 403 and resp.json()["error"]["type"] == "forbidden"
        # rewards, logs and its own tool calls still go in
        await a.add_span(_span(mine, Reward(value=1.0)))
        await a.add_span(_span(mine, Log(message="hi")))
        await a.add_span(_span(mine, ToolCall(name="calc", arguments={"x": 1}, result=2)))
        kinds = [s.kind for s in await admin.query_spans(mine.rollout_id)]
        assert kinds == ["reward", "log", "tool_call"]
        await admin.add_span(_span(mine, forged))  # the admin (the trainer, its proxy) may
    finally:
        for c in (admin, a, b):
            await c.close()


async def test_a_runner_reads_only_its_own_attempts(served: StoreServer) -> None:
    admin, a, b, mine, theirs = await _two_runners(served)
    try:
        await b.add_span(_span(theirs, Reward(value=1.0)))
        rid, aid = theirs.rollout_id, theirs.attempt.attempt_id
        for read in (
            a.get_rollout(rid),
            a.list_attempts(rid),
            a.get_attempt(rid, aid),
            a.get_rollout_attempt(rid, aid),
            a.query_spans(rid),
            a.query_spans(rid, aid),
            a.wait_for_rollouts([rid], timeout=0),
            a.list_rollouts(),
            a.check_timeouts(),
        ):
            with pytest.raises(InvalidRequestError, match=r"runner 'a' may (not|read only)"):
                await read
        # its own: the attempt, its spans and its rollout, without the task's reference
        assert mine.input == {"question": "2+2"}
        assert (await a.get_rollout(mine.rollout_id)).input == {"question": "2+2"}
        pair = await a.get_rollout_attempt(mine.rollout_id, mine.attempt.attempt_id)
        assert pair[0].input == {"question": "2+2"}
        assert [x.attempt_id for x in await a.list_attempts(mine.rollout_id)] == [mine.attempt.attempt_id]
        assert await a.query_spans(mine.rollout_id) == []
        assert await a.wait_for_rollouts([mine.rollout_id], timeout=0) == []
        # the admin reads everything, the reference included
        assert (await admin.get_rollout(mine.rollout_id)).input["reference"] == "4"
    finally:
        for c in (admin, a, b):
            await c.close()


async def test_a_runner_reads_no_proxy_key_from_the_resources(served: StoreServer) -> None:
    admin, a, b, _mine, _ = await _two_runners(served)
    try:
        for read in (a.get_latest_resources(), a.get_resources(1)):
            resources = await read
            assert resources is not None
            llm = resources.items["llm"]
            assert isinstance(llm, ProxyLLM) and llm.api_key == "EMPTY" and llm.url_template == TEMPLATE
        latest = await admin.get_latest_resources()
        assert latest is not None and latest.items["llm"].api_key == "the-proxy-key"
    finally:
        for c in (admin, a, b):
            await c.close()


async def test_long_polls_are_capped_per_key(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        async with StoreServer(store, admin_key=ADMIN, max_waits_per_key=4) as server:
            await _capped(server, 4)
        async with StoreServer(store, admin_key=ADMIN) as server:
            assert MAX_WAITS_PER_KEY == 16
            await _capped(server, MAX_WAITS_PER_KEY)
    finally:
        await store.close()


async def _capped(server: StoreServer, cap: int) -> None:
    admin = StoreClient(server.url, api_key=ADMIN)
    hog = StoreClient(server.url, api_key=server.runner_key("hog"), max_connections=cap + 4)
    other = StoreClient(server.url, api_key=server.runner_key("other"))
    try:
        rollout = await admin.enqueue_rollout({"task": 1})
        owned = await hog.dequeue_rollout()
        assert owned is not None and owned.rollout_id == rollout.rollout_id
        async with anyio.create_task_group() as tg:
            for _ in range(cap):  # the hog holds its share of long-polls
                tg.start_soon(hog.wait_for_rollouts, [rollout.rollout_id], 30)
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                with anyio.fail_after(30):  # until the hog's waits have all reached the server
                    while True:
                        resp = await http.post(
                            "/v1/wait",
                            json={"rollout_ids": [rollout.rollout_id], "timeout": 0.2},
                            headers={"authorization": f"Bearer {server.runner_key('hog')}"},
                        )
                        if resp.status_code != 200:
                            break
            assert resp.status_code == 429, resp.text
            assert resp.json()["error"]["type"] == "too_many_waits"
            assert f"at most {cap} at once" in resp.json()["error"]["message"]
            with pytest.raises(StoreUnavailableError, match="429"):
                await hog.wait_for_rollouts([rollout.rollout_id], timeout=1)
            # every other key is still answered, long-polls included
            with anyio.fail_after(5):
                assert await admin.wait_for_rollouts([rollout.rollout_id], timeout=0.1) == []
                assert await other.dequeue_rollout() is None
            await admin.cancel_rollout(rollout.rollout_id)  # the hog's waits return
        resp_ok = await hog.wait_for_rollouts([rollout.rollout_id], timeout=0)  # the slots came back
        assert [r.status for r in resp_ok] == ["cancelled"]
    finally:
        for c in (admin, hog, other):
            await c.close()
