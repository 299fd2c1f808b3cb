"""Security defaults: loopback binding, bearer tokens, attempt isolation, body limits, no unsafe decoding."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop.errors import NotFoundError
from agentloop.proxy.server import Proxy
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout, Reward, Span
from tests.proxy.engines import EchoEngine
from tests.reliability.conftest import REPO, running_proxy

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _attempt(store: Any) -> AttemptedRollout:
    await store.enqueue_rollout({"q": 1})
    attempted = await store.dequeue_rollout("w")
    assert attempted is not None
    return attempted


def _url(proxy: Proxy, a: AttemptedRollout) -> str:
    return proxy.as_resource().get_base_url(a.rollout_id, a.attempt.attempt_id)


async def test_servers_bind_loopback_by_default(tokenizer: Any) -> None:
    assert inspect.signature(Proxy).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(StoreServer).parameters["host"].default == "127.0.0.1"
    async with StoreServer(MemoryStore()) as server:
        assert server.url.startswith("http://127.0.0.1:")
    async with running_proxy(EchoEngine(tokenizer), MemoryStore()) as proxy:
        assert proxy.url.startswith("http://127.0.0.1:")


async def test_bearer_token_required_by_both_servers(tokenizer: Any) -> None:
    store = MemoryStore()
    async with StoreServer(store, api_key="k1") as server, httpx.AsyncClient(timeout=10) as http:
        for method, path in (("POST", "/v1/dequeue"), ("GET", "/v1/rollouts/x"), ("POST", "/v1/spans")):
            assert (await http.request(method, server.url + path, json={})).status_code == 401
        wrong = await http.post(server.url + "/v1/dequeue", json={}, headers={"authorization": "Bearer k2"})
        assert wrong.status_code == 401
        ok = await http.post(server.url + "/v1/dequeue", json={}, headers={"authorization": "Bearer k1"})
        assert ok.status_code == 200
    async with running_proxy(EchoEngine(tokenizer), store, api_key="k1") as proxy:
        a = await _attempt(store)
        async with httpx.AsyncClient(timeout=10) as http:
            url = _url(proxy, a) + "/chat/completions"
            assert (await http.post(url, json=CHAT)).status_code == 401
            assert (
                await http.post(url, json=CHAT, headers={"authorization": "Bearer no"})
            ).status_code == 401
            assert (
                await http.post(proxy.session_base_url + "/chat/completions", json=CHAT)
            ).status_code == 401
            assert (
                await http.post(url, json=CHAT, headers={"authorization": "Bearer k1"})
            ).status_code == 200


@pytest.mark.parametrize("backend", ["memory", "sqlite", "http"])
async def test_a_span_cannot_land_in_another_rollouts_attempt(backend: str, tmp_path: Path) -> None:
    inner: Any = MemoryStore() if backend == "memory" else SQLiteStore(tmp_path / "s.db")
    server = StoreServer(inner) if backend == "http" else None
    if server is not None:
        await server.start()
    store: Any = StoreClient(server.url) if server is not None else inner
    try:
        a, b = await _attempt(store), await _attempt(store)
        foreign = Span(rollout_id=a.rollout_id, attempt_id=b.attempt.attempt_id, payload=Reward(value=1.0))
        with pytest.raises(NotFoundError, match=b.attempt.attempt_id):
            await store.add_span(foreign)
        assert await store.query_spans(a.rollout_id) == [] and await store.query_spans(b.rollout_id) == []
    finally:
        await store.close()
        if server is not None:
            await server.stop()
            await inner.close()


async def test_proxy_route_of_one_attempt_cannot_record_into_another(tokenizer: Any) -> None:
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer), store) as proxy, httpx.AsyncClient(timeout=10) as http:
        a, b = await _attempt(store), await _attempt(store)
        mixed = proxy.as_resource().get_base_url(a.rollout_id, b.attempt.attempt_id)
        resp = await http.post(mixed + "/chat/completions", json=CHAT)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        assert await store.query_spans(a.rollout_id) == [] and await store.query_spans(b.rollout_id) == []
        ok = await http.post(_url(proxy, a) + "/chat/completions", json=CHAT)
        assert ok.status_code == 200
        assert len(await store.query_spans(a.rollout_id)) == 1 and await store.query_spans(b.rollout_id) == []


async def test_request_bodies_are_limited_413(tokenizer: Any) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 40_000}]}
    async with running_proxy(EchoEngine(tokenizer), MemoryStore(), max_body_bytes=16_384) as proxy:
        async with httpx.AsyncClient(timeout=10) as http:
            resp = await http.post(proxy.session_base_url + "/chat/completions", json=big)
            assert resp.status_code == 413
    async with (
        StoreServer(MemoryStore(), max_body_bytes=16_384) as server,
        httpx.AsyncClient(timeout=10) as http,
    ):
        resp = await http.post(server.url + "/v1/rollouts", json={"input": "x" * 40_000})
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "payload_too_large"


NETWORK_FACING = ["agentloop/store", "agentloop/proxy", "agentloop/runner.py", "agentloop/agent.py",
                  "agentloop/client.py", "agentloop/resources.py", "agentloop/types.py", "integrations"]  # fmt: skip
UNSAFE = re.compile(
    r"\bimport pickle\b|\bpickle\.|\bcloudpickle\b|\bmarshal\.loads\b|(?<![\w.])eval\(|(?<![\w.])exec\("
    r"|yaml\.load\((?![^)]*SafeLoader)|yaml\.unsafe_load|shelve\.|torch\.load\((?![^)]*weights_only=True)"
)


def test_nothing_from_the_network_is_unpickled_or_evaluated() -> None:
    files = [p for entry in NETWORK_FACING for p in sorted((REPO / entry).rglob("*.py")) or [REPO / entry]]
    assert len(files) > 10
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNSAFE.search(line) and not line.lstrip().startswith("#")
    ]
    assert hits == [], "unsafe decoding in network-facing code:\n" + "\n".join(hits)
