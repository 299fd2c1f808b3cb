"""Keys (issue 16): the trainer's proxy has a key per run that agents get as ``llm.api_key`` (remote
runners through the store); keys come from env:/file: references, stay SecretStr in configs, and
never reach run folders, W&B or reprs; our openai clients never retry (a retry records twice)."""

from __future__ import annotations

import json
import sqlite3
import sys
import types
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from pydantic import SecretStr

import agentloop as al
from agentloop.errors import ConfigError
from agentloop.keys import read_key
from agentloop.proxy.bearer_auth import BearerAuth
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.runner import Runner
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine
from trainer.config import TrainerConfig

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SECRET = "sk-store-9f8e7d6c"


# ---------------------------------------------------------------- key references


def test_keys_come_from_env_or_file_and_errors_never_show_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AL_TEST_KEY", SECRET)
    key_file = tmp_path / "k"
    key_file.write_text(f"{SECRET}\n")
    for ref in ("env:AL_TEST_KEY", f"file:{key_file}", SECRET, SecretStr(SECRET)):
        key = read_key(ref)
        assert isinstance(key, SecretStr) and key.get_secret_value() == SECRET
        assert SECRET not in repr(key) and SECRET not in str(key)
    assert read_key(None) is None and read_key("") is None
    monkeypatch.setenv("AL_TEST_BAD", f"{SECRET} x")
    key_file.write_text("")
    for ref, match in [("env:AL_TEST_UNSET", "AL_TEST_UNSET.*not set"), (f"file:{key_file}", "is empty"),
                       (f"file:{tmp_path / 'none'}", "cannot read the key file"),
                       ("env:AL_TEST_BAD", "whitespace"), (f"{SECRET} x", "whitespace")]:  # fmt: skip
        with pytest.raises(ValueError, match=match) as info:
            read_key(ref, "--api-key")
        assert SECRET not in str(info.value)


def test_store_api_key_is_a_secret_in_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AL_TEST_STORE_KEY", SECRET)
    cfg = TrainerConfig.from_dict(
        {"placement": {"store_server": True, "store_api_key": "env:AL_TEST_STORE_KEY"}}
    )
    key = cfg.placement.store_api_key
    assert isinstance(key, SecretStr) and key.get_secret_value() == SECRET
    for text in (
        cfg.model_dump_json(),
        json.dumps(cfg.model_dump(mode="json")),
        repr(cfg),
        str(cfg.model_dump()),
    ):
        assert SECRET not in text
    assert json.loads(cfg.model_dump_json())["placement"]["store_api_key"] == "**********"
    again = cfg.with_overrides(["placement.store_port=9"])  # overrides keep the key itself
    assert again.placement.store_api_key is not None
    assert again.placement.store_api_key.get_secret_value() == SECRET
    key_file = tmp_path / "store.key"
    key_file.write_text(SECRET)
    from_file = TrainerConfig.from_dict({"placement": {"store_api_key": f"file:{key_file}"}})
    assert from_file.placement.store_api_key == SecretStr(SECRET)
    with pytest.raises(ConfigError, match=r"placement\.store_api_key: .*AL_TEST_UNSET") as info:
        TrainerConfig.from_dict({"placement": {"store_api_key": "env:AL_TEST_UNSET"}})
    assert SECRET not in str(info.value)
    with pytest.raises(ConfigError, match=r"store_host='0\.0\.0\.0' is not a loopback address"):
        TrainerConfig.from_dict({"placement": {"store_server": True, "store_host": "0.0.0.0"}})
    TrainerConfig.from_dict(
        {"placement": {"store_server": True, "store_host": "0.0.0.0", "store_api_key": SECRET}}
    )


def test_keys_stay_out_of_reprs(tokenizer: Any) -> None:
    llm = LLM(base_url="http://h/v1", model="m", api_key=SECRET)
    res = ProxyLLM(
        url_template="http://h/rollout/{rollout_id}/attempt/{attempt_id}/v1", model="m", api_key=SECRET
    )
    for obj in (llm, res, Resources(items={"llm": res})):
        assert SECRET not in repr(obj) and SECRET not in str(obj)
    assert llm.api_key == SECRET and res.api_key == SECRET  # agents pass llm.api_key to openai
    assert json.loads(res.model_dump_json())["api_key"] == SECRET  # remote runners read it from the store
    auth = BearerAuth(SecretStr(SECRET))  # what the app's closures hold, as a traceback would print it
    assert SECRET not in repr(auth) and auth.required
    proxy = al.Proxy(EchoEngine(tokenizer), MemoryStore(), api_key=SECRET)
    assert isinstance(proxy.api_key, SecretStr) and SECRET not in repr(vars(proxy))


# ---------------------------------------------------------------- the key reaches agents


async def test_the_proxy_key_reaches_local_and_remote_agents(tokenizer: Any) -> None:
    """Agents that pass llm.api_key (or use al.async_openai_client) get answers; a caller without
    the key gets 401, also through a StoreClient as `agentloop runner` uses it."""
    from secrets import token_urlsafe

    key = token_urlsafe(32)
    statuses: list[int] = []

    @al.rollout
    async def agent(task: dict, llm: al.LLM) -> float:
        async with httpx.AsyncClient(timeout=10) as http:  # no key
            statuses.append((await http.post(f"{llm.base_url}/chat/completions", json=CHAT)).status_code)
        async with al.async_openai_client() as client:
            await client.chat.completions.create(model=llm.model, **CHAT)  # type: ignore[call-overload]
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            await client.chat.completions.create(model=llm.model, **CHAT)  # type: ignore[call-overload]
        return 1.0

    inner = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer), inner, api_key=key) as proxy:
        await inner.add_resources(Resources(items={"llm": proxy.as_resource()}))
        async with StoreServer(inner) as server, StoreClient(server.url) as remote:
            resources = await remote.get_latest_resources()
            assert resources is not None and resources.get_llm().api_key == key
            for store in (inner, remote):
                await store.enqueue_rollout({"q": 1})
                with anyio.fail_after(30):
                    stats = await Runner(agent, store).run(max_rollouts=1)
                assert stats.succeeded == 1, stats
    assert statuses == [401, 401]


# ---------------------------------------------------------------- no retries


def test_our_openai_clients_do_not_retry() -> None:
    llm = LLM(base_url="http://127.0.0.1:9/v1", model="m")
    assert al.openai_client(llm).max_retries == 0
    assert al.async_openai_client(llm).max_retries == 0
    assert al.async_openai_client(llm, max_retries=3).max_retries == 3  # still the caller's choice


async def test_a_timed_out_call_is_sent_once(tokenizer: Any) -> None:
    """openai retries a timed-out call (twice by default); each try would be a recorded sample."""
    engine, store = EchoEngine(tokenizer, delay_s=0.6), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        llm = LLM(base_url=attempt_url(proxy, await new_attempt(store)), model="m")
        async with al.async_openai_client(llm, timeout=0.2) as client:
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="m", **CHAT)  # type: ignore[call-overload]
        await anyio.sleep(2.5)  # openai's backoff (0.5-1 s) would have sent the retries by now
    assert len(engine.calls) == 1


# ---------------------------------------------------------------- the trainer


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_trainer_keys_its_proxy_and_keeps_keys_out_of_the_run(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step of the whole loop: each attempt gets its own proxy key (issue 44: derived from the per-run
    key, which is never stored) and an unkeyed request gets 401; the store key (from env:) is not in the
    run folder, and W&B gets it masked."""
    from trainer import Trainer

    seen: list[tuple[str, int]] = []

    @al.rollout
    async def agent(task: dict, llm: al.LLM) -> float:
        async with httpx.AsyncClient(timeout=30) as http:
            unkeyed = (await http.post(f"{llm.base_url}/chat/completions", json=CHAT)).status_code
        seen.append((llm.api_key, unkeyed))
        async with al.async_openai_client(timeout=60) as client:
            resp = await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task["prompt"]}],
                temperature=1.0, extra_body={"return_token_ids": True},
            )  # fmt: skip
        return ((resp.model_extra or {})["token_ids"][0] % 997) / 997

    wandb_configs: list[dict[str, Any]] = []

    class _Run:
        def log(self, *a: Any, **k: Any) -> None: ...
        def finish(self) -> None: ...

    def init(project: str, name: str, config: dict[str, Any]) -> _Run:
        wandb_configs.append(config)
        return _Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))  # the network edge
    monkeypatch.setenv("AL_TEST_STORE_KEY", SECRET)
    run_dir = tmp_path / "run"
    cfg = {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2, "concurrency": 8},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
        },
        "trainer": {"total_training_steps": 1, "default_local_dir": str(run_dir), "device": "cpu",
                    "logger": ["jsonl", "wandb"], "val_before_train": False},
        "placement": {"store_server": True, "store_api_key": "env:AL_TEST_STORE_KEY"},
    }  # fmt: skip
    tasks = [{"prompt": f"Name a colour, number {i}."} for i in range(2)]
    result = Trainer(cfg).fit(agent, tasks)
    keys = {k for k, _ in seen}
    assert len(keys) == len(seen) == 4 and all(k.startswith("attempt.") for k in keys), "a key per attempt"
    stored = [json.loads(row[0]) for row in sqlite3.connect(result.run_dir / "store.db").execute(
        "SELECT data FROM resources")]  # fmt: skip
    assert stored and {r["items"]["main_llm"]["api_key"] for r in stored} == {"per-attempt"}, "no key at rest"
    assert {status for _, status in seen} == {401}
    assert (
        json.loads((result.run_dir / "config.json").read_text())["placement"]["store_api_key"] == "**********"
    )
    for path in result.run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the store key is in {path}"
    assert wandb_configs and SECRET not in repr(wandb_configs)
    assert wandb_configs[0]["placement"]["store_api_key"] == "**********"
