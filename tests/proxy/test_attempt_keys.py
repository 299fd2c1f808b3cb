"""Per-attempt proxy keys (issue 44, finding 3): the review read the one per-run proxy key out of the
store's resources with a runner key and wrote LLM calls into another runner's live attempt through the
proxy. Now the resources hold no key, each dequeued attempt gets its own (an HMAC of the attempt with the
proxy's key) and that key opens its own attempt's route only. Also finding 1 at the session reward route:
a reward out of +-1e6 is a 400 naming the range.

Real components: a Proxy (EchoEngine with the real tokenizer) on a loopback port, a SQLiteStore, a
StoreServer with runner keys and StoreClients as ``agentloop runner`` uses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop.proxy.attempt_keys import PER_ATTEMPT, AttemptKeyStore, attempt_key
from agentloop.resources import ProxyLLM, Resources
from agentloop.store.client import StoreClient
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from tests.proxy.conftest import running_proxy
from tests.proxy.engines import EchoEngine

PROXY_KEY = "per-run-proxy-key-0123456789abcdef"
ADMIN = "store-admin-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _chat(url: str, key: str) -> int:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(
            f"{url}/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}
        )
    return resp.status_code


def test_attempt_keys_are_derived_per_attempt() -> None:
    a = attempt_key(PROXY_KEY, "ro-1", "at-1")
    assert a.startswith("attempt.") and PROXY_KEY not in a
    assert a == attempt_key(PROXY_KEY, "ro-1", "at-1")
    others = {attempt_key(PROXY_KEY, "ro-1", "at-2"), attempt_key(PROXY_KEY, "ro-2", "at-1"),
              attempt_key(PROXY_KEY, "ro-1a", "t-1"), attempt_key("another-key", "ro-1", "at-1")}  # fmt: skip
    assert a not in others and len(others) == 4
    with pytest.raises(ValueError, match="needs the proxy's key"):
        attempt_key("", "ro-1", "at-1")


async def test_an_attempt_key_opens_its_own_attempt_only(tokenizer: Any, tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "store.db")
    async with running_proxy(EchoEngine(tokenizer), store, api_key=PROXY_KEY) as proxy:
        stored = proxy.as_resource().model_copy(update={"api_key": PER_ATTEMPT})
        await store.add_resources(Resources(items={"llm": stored}))
        keyed = AttemptKeyStore(store, proxy)
        await keyed.enqueue_rollout({"q": 1})
        await keyed.enqueue_rollout({"q": 2})
        a, b = await keyed.dequeue_rollout("w"), await keyed.dequeue_rollout("w")
        assert a is not None and b is not None and a.resources is not None and b.resources is not None
        llm_a = a.resources.get_llm()
        assert isinstance(llm_a, ProxyLLM)
        resolved_a, resolved_b = llm_a.resolve(a), b.resources.get_llm().resolve(b)  # type: ignore[union-attr]
        assert resolved_a.api_key == attempt_key(PROXY_KEY, a.rollout_id, a.attempt.attempt_id)
        assert resolved_a.api_key != resolved_b.api_key
        assert await _chat(resolved_a.base_url, resolved_a.api_key) == 200
        assert await _chat(resolved_b.base_url, resolved_b.api_key) == 200
        # A's key on B's attempt, the stored placeholder, a made-up attempt key: 401, nothing recorded
        assert await _chat(resolved_b.base_url, resolved_a.api_key) == 401
        assert await _chat(resolved_b.base_url, PER_ATTEMPT) == 401
        assert await _chat(resolved_b.base_url, "attempt." + "0" * 64) == 401
        assert len(await store.query_spans(b.rollout_id)) == 1
        assert await _chat(resolved_b.base_url, PROXY_KEY) == 200  # the trainer's own key still opens all
        # no key at rest: the resources in store.db name no key
        latest = await store.get_latest_resources()
        assert latest is not None and latest.get_llm().api_key == PER_ATTEMPT
    await store.close()
    assert PROXY_KEY.encode() not in (tmp_path / "store.db").read_bytes()


async def test_a_runner_cannot_write_into_another_runners_attempt(tokenizer: Any, tmp_path: Path) -> None:
    """The review's attack: runner B reads the resources with its runner key, takes the proxy key out of
    them and posts a chat on runner A's attempt URL, which the proxy records as A's LLM call."""
    store = SQLiteStore(tmp_path / "store.db")
    async with running_proxy(EchoEngine(tokenizer), store, api_key=PROXY_KEY) as proxy:
        stored = proxy.as_resource().model_copy(update={"api_key": PER_ATTEMPT})
        await store.add_resources(Resources(items={"llm": stored}))
        async with StoreServer(AttemptKeyStore(store, proxy), admin_key=ADMIN) as server:  # type: ignore[arg-type]
            admin = StoreClient(server.url, api_key=ADMIN)
            runner_a = StoreClient(server.url, api_key=server.runner_key("a"))
            runner_b = StoreClient(server.url, api_key=server.runner_key("b"))
            try:
                await admin.enqueue_rollout({"q": "a"})
                await admin.enqueue_rollout({"q": "b"})
                a, b = await runner_a.dequeue_rollout(), await runner_b.dequeue_rollout()
                assert a is not None and b is not None and a.resources is not None and b.resources is not None
                url_a = a.resources.get_llm().resolve(a).base_url  # type: ignore[union-attr]
                own_b = b.resources.get_llm().resolve(b)  # type: ignore[union-attr]
                assert await _chat(own_b.base_url, own_b.api_key) == 200  # B's own attempt works
                read = await runner_b.get_latest_resources()
                assert read is not None
                for key in {read.get_llm().api_key, own_b.api_key, b.resources.get_llm().api_key}:
                    assert await _chat(url_a, key) == 401, f"runner B wrote into A's attempt with {key:.12}"
                assert await admin.query_spans(a.rollout_id) == []
            finally:
                for client in (admin, runner_a, runner_b):
                    await client.close()
    await store.close()


async def test_a_session_reward_out_of_range_is_a_400(tokenizer: Any) -> None:
    """Finding 1 at the app route: two rewards of 1.7e308 on one session summed to inf and killed
    ``serve --train``; each is refused, saying the range and the value."""
    async with running_proxy(EchoEngine(tokenizer), api_key=PROXY_KEY) as proxy:
        headers = {"authorization": f"Bearer {PROXY_KEY}", "x-session-id": "s1"}
        async with httpx.AsyncClient(base_url=proxy.session_base_url, timeout=30, headers=headers) as http:
            assert (await http.post("/chat/completions", json=CHAT)).status_code == 200
            for value in (1.7e308, -1e7):
                resp = await http.post("/sessions/s1/reward", json={"value": value})
                assert resp.status_code == 400, resp.text
                message = resp.json()["error"]["message"]
                assert "within +-1e+06" in message and f"got {value:g}" in message, message
            assert (await http.post("/sessions/s1/reward", json={"value": 1e6})).status_code == 200
            assert [r["value"] for r in (await http.get("/sessions/s1")).json()["rewards"]] == [1e6]
