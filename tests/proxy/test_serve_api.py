"""The app-facing routes `agentloop serve` documents: the served model's name, sessions, rewards, listing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx

from agentloop.proxy.server import Proxy, served_model_name
from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_models_lists_the_served_model_and_sessions_refuse_other_names(
    tokenizer: Any, tiny_model_dir: Path
) -> None:
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer), store) as proxy, httpx.AsyncClient(timeout=20) as http:
        v1 = proxy.session_base_url
        with anyio.fail_after(30):
            models = (await http.get(f"{v1}/models")).json()
            unknown = await http.post(
                f"{v1}/chat/completions", json={"model": "gpt-4o", "messages": MESSAGES}
            )
            comp_unknown = await http.post(f"{v1}/completions", json={"model": "gpt-4o", "prompt": "hi"})
            served = await http.post(
                f"{v1}/chat/completions", json={"model": proxy.model_name, "messages": MESSAGES}
            )
            legacy = await http.post(
                f"{v1}/chat/completions", json={"model": "agentloop", "messages": MESSAGES}
            )
            unnamed = await http.post(f"{v1}/chat/completions", json={"messages": MESSAGES})
            att = await new_attempt(store)  # training agents name whatever their LLM resource says
            per_attempt = await http.post(
                attempt_url(proxy, att) + "/chat/completions", json={"model": "m", "messages": MESSAGES}
            )
    name = tiny_model_dir.name  # the model folder's name, not "agentloop"
    assert proxy.model_name == name == served_model_name(proxy.engine)
    assert [m["id"] for m in models["data"]] == [name]
    for refused in (unknown, comp_unknown):
        assert refused.status_code == 404  # what the OpenAI API answers for a model it does not have
        error = refused.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gpt-4o' does not exist" in error["message"] and f"serves {name!r}" in error["message"]
    assert [r.status_code for r in (served, legacy, unnamed, per_attempt)] == [200, 200, 200, 200]
    assert served.json()["model"] == name


def test_served_name_of_a_hub_snapshot() -> None:
    class Tok:
        name_or_path = "/cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc123"

    class Engine:
        tokenizer = Tok()

    assert served_model_name(Engine()) == "Qwen/Qwen2.5-0.5B-Instruct"  # type: ignore[arg-type]
    Tok.name_or_path = ""
    assert served_model_name(Engine()) == "agentloop"  # type: ignore[arg-type]


async def test_reward_body_value_or_reward_and_session_listing(tokenizer: Any) -> None:
    async with running_proxy(EchoEngine(tokenizer)) as proxy, httpx.AsyncClient(timeout=20) as http:
        v1 = proxy.session_base_url
        with anyio.fail_after(30):
            for sid in ("app-1", "app-2"):
                ok = await http.post(
                    f"{v1}/chat/completions", json={"messages": MESSAGES}, headers={"X-Session-Id": sid}
                )
                assert ok.status_code == 200 and ok.headers["x-session-id"] == sid
            as_value = await http.post(f"{v1}/sessions/app-1/reward", json={"value": 1.0, "name": "thumbs"})
            as_reward = await http.post(f"{v1}/sessions/app-2/reward", json={"reward": 0.5})
            both = await http.post(f"{v1}/sessions/app-2/reward", json={"reward": 0.5, "value": 1.0})
            neither = await http.post(f"{v1}/sessions/app-2/reward", json={"score": 0.5})
            listing = (await http.get(f"{v1}/sessions")).json()
            one = (await http.get(f"{v1}/sessions/app-2")).json()
    assert as_value.status_code == 200 and as_value.json()["rewards"] == [
        {"kind": "reward", "value": 1.0, "name": "thumbs"}
    ]
    assert as_reward.status_code == 200 and as_reward.json()["rewards"][0]["value"] == 0.5
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "value"
    assert listing["object"] == "list"
    assert [
        (s["session_id"], s["num_calls"], [r["value"] for r in s["rewards"]]) for s in listing["data"]
    ] == [
        ("app-1", 1, [1.0]),
        ("app-2", 1, [0.5]),
    ]
    assert len(one["calls"]) == 1 and one["calls"][0]["prompt_ids"] and one["rewards"][0]["value"] == 0.5


async def test_sessions_are_saved_only_in_a_sqlite_store(tokenizer: Any, tmp_path: Path) -> None:
    assert Proxy(EchoEngine(tokenizer), MemoryStore()).session_store is None  # memory only
    store = SQLiteStore(tmp_path / "store.db")
    try:
        assert Proxy(EchoEngine(tokenizer), store, record_sessions=False).session_store is None
        async with Proxy(EchoEngine(tokenizer), store) as proxy:
            assert proxy.session_store == tmp_path / "store.db"
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("store.db")) == []
    finally:
        await store.close()
