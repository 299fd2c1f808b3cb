"""The HTTP store answers bad requests with 4xx and a JSON error body, never 500; bearer tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentloop.errors import StoreUnavailableError
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    async with StoreServer(MemoryStore(), max_body_bytes=1 << 20) as srv:
        yield srv


@pytest.fixture
async def http(server: StoreServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        yield client


def assert_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return str(body["error"]["message"])


async def test_url_reports_the_bound_port(server: StoreServer) -> None:
    assert server.port != 0 and server.url == f"http://127.0.0.1:{server.port}"


async def test_malformed_json_is_400(http: httpx.AsyncClient) -> None:
    for path in ("/v1/rollouts", "/v1/spans", "/v1/dequeue", "/v1/wait", "/v1/resources"):
        resp = await http.post(path, content=b'{"input": [1, 2', headers={"content-type": "application/json"})
        assert "not valid JSON" in assert_error(resp, 400, "invalid_json")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/rollouts", {"input": 1, "mode": "nope"}, "mode"),
        ("/v1/rollouts", {"input": 1, "config": {"max_attempts": "many"}}, "config.max_attempts"),
        ("/v1/rollouts", {"input": 1, "surprise": True}, "surprise"),
        ("/v1/rollouts", [1, 2], "body"),
        ("/v1/dequeue", {"worker_id": 5}, "worker_id"),
        ("/v1/wait", {"rollout_ids": "ro-1", "timeout": 1}, "rollout_ids"),
        ("/v1/wait", {"rollout_ids": [], "timeout": -1}, "timeout"),
        ("/v1/spans", {"rollout_id": "r", "attempt_id": "a", "payload": {"kind": "nope"}}, "payload"),
        ("/v1/resources", {"items": {"x": {"resource_type": "llm"}}}, "items"),
        ("/v1/rollouts/list", {"status": ["bogus"]}, "status"),
    ],
)
async def test_wrong_types_are_422(http: httpx.AsyncClient, path: str, body: object, field: str) -> None:
    message = assert_error(await http.post(path, json=body), 422, "invalid_request")
    assert field in message


async def test_unknown_ids_are_404_and_stale_is_409(http: httpx.AsyncClient) -> None:
    assert "ro-x" in assert_error(await http.get("/v1/rollouts/ro-x"), 404, "not_found")
    assert_error(
        await http.post("/v1/rollouts/ro-x/attempts/at-y", json={"status": "succeeded"}), 404, "not_found"
    )
    assert_error(await http.get("/v1/resources/9"), 404, "not_found")
    assert_error(await http.get("/v1/resources/abc"), 422, "invalid_request")
    assert_error(await http.get("/v1/no/such/route"), 404, "not_found")
    assert_error(await http.delete("/v1/rollouts/ro-x"), 405, "method_not_allowed")
    rid = (await http.post("/v1/rollouts", json={"input": 1})).json()["rollout_id"]
    aid = (await http.post("/v1/dequeue", json={})).json()["attempt"]["attempt_id"]
    ok = await http.post(f"/v1/rollouts/{rid}/attempts/{aid}", json={"status": "succeeded"})
    assert ok.status_code == 200 and ok.json()["status"] == "succeeded"
    again = await http.post(
        "/v1/spans", json={"rollout_id": rid, "attempt_id": aid, "payload": {"kind": "log", "message": "m"}}
    )
    assert "already finished" in assert_error(again, 409, "stale_attempt")
    assert_error(await http.post(f"/v1/rollouts/{rid}/cancel"), 409, "invalid_transition")


async def test_huge_body_is_413(http: httpx.AsyncClient) -> None:
    big = b'{"input": "' + b"x" * (2 << 20) + b'"}'
    assert_error(await http.post("/v1/rollouts", content=big), 413, "payload_too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no content-length: counted while streaming
        for _ in range(40):
            yield b"x" * 65536

    assert_error(await http.post("/v1/rollouts", content=chunks()), 413, "payload_too_large")


async def test_bearer_token() -> None:
    async with StoreServer(MemoryStore(), api_key="s3cret") as server:
        async with httpx.AsyncClient(base_url=server.url) as raw:
            assert_error(await raw.post("/v1/dequeue", json={}), 401, "unauthorized")
            bad = await raw.post("/v1/dequeue", json={}, headers={"authorization": "Bearer nope"})
            assert_error(bad, 401, "unauthorized")
        async with StoreClient(server.url, api_key="wrong") as wrong:
            with pytest.raises(StoreUnavailableError, match="401"):
                await wrong.dequeue_rollout()
        async with StoreClient(server.url, api_key="s3cret") as good:
            rollout = await good.enqueue_rollout({"x": 1})
            assert (await good.get_rollout(rollout.rollout_id)).input == {"x": 1}


async def test_unreachable_server_raises_store_unavailable() -> None:
    async with StoreServer(MemoryStore()) as server:
        url = server.url
    async with StoreClient(url, timeout=2) as client:
        with pytest.raises(StoreUnavailableError, match="unreachable"):
            await client.get_latest_resources()
