"""Issue 19, online training from app traffic: rewarded sessions become an update, the gate promotes a
candidate that scores well and refuses one that drops (the policy goes back), rollback over the admin
API, untrained sessions counted, the promotion log.

Real components: a real Proxy on a loopback port over a SQLiteStore with a real TorchEngine (the tiny
model with the real tokenizer), the real TrainerWorker and a second engine for the gate. The
evaluation is a real coroutine that asks the candidate engine; its score is set by the test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from agentloop.engine.torch_engine import TorchEngine
from agentloop.proxy.admin import add_admin_routes
from agentloop.proxy.server import Proxy
from agentloop.store.sqlite import SQLiteStore
from trainer.online import OnlineConfig, OnlineTrainer, jsonl_evaluator, online_trainer_config


async def _chat(http: httpx.AsyncClient, proxy: Proxy, session: str, text: str) -> None:
    r = await http.post(
        f"{proxy.session_base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 1.0},
        headers={"X-Session-Id": session},
    )
    assert r.status_code == 200, r.text


async def _reward(http: httpx.AsyncClient, proxy: Proxy, session: str, value: float) -> None:
    r = await http.post(f"{proxy.session_base_url}/sessions/{session}/reward", json={"value": value})
    assert r.status_code == 200, r.text


def _engine_weights(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine._model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    shared = [k for k in b if k in a]
    assert len(shared) >= len(b) - 1, "the two hold the same model's weights (a tied head may be left out)"
    return all(torch.equal(a[k].float(), b[k].float()) for k in shared)


@pytest.mark.e2e
async def test_sessions_train_the_gate_promotes_or_refuses_and_rollback_restores(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    scores = iter([0.5, 0.6, 0.1])  # v0's baseline, a better candidate, one that drops past the margin
    asked: list[str] = []

    async def evaluate(base_url: str, model: str, api_key: str | None) -> float:
        async with httpx.AsyncClient() as http:  # the candidate engine answers, not the serving one
            asked.append((await http.get(f"{base_url}/models")).json()["data"][0]["id"])
        return next(scores)

    config, online = online_trainer_config(
        {"online": {"sessions_per_update": 2, "settle_s": 0, "margin": 0.05},
         "data": {"max_prompt_length": 64, "max_response_length": 16},
         "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-2, "weight_decay": 0.0}}}},
        str(tiny_model_dir), "cpu",
    )  # fmt: skip
    assert config.algorithm.adv_estimator == "reinforce_plus_plus" and config.actor_rollout_ref.rollout.n == 1
    engine = TorchEngine(tiny_model_dir, device="cpu")
    store = SQLiteStore(tmp_path / "serve.db")
    proxy = Proxy(engine, store)
    trainer = OnlineTrainer(proxy, config, online, tiny_model_dir, tmp_path / "run", evaluate=evaluate)
    add_admin_routes(proxy.app, trainer, proxy.api_key)
    v0 = _engine_weights(engine)
    try:
        await proxy.start()
        await trainer.start()
        async with httpx.AsyncClient(timeout=60) as http:
            with anyio.fail_after(120):
                for sid, reward in (("s1", 1.0), ("s2", 0.0)):
                    await _chat(http, proxy, sid, "Say hi")
                    await _reward(http, proxy, sid, reward)
                await _chat(http, proxy, "no-reward", "Say hi")
                assert trainer.ready_sessions() == ["s1", "s2"]  # rewarded ones only
                metrics = await trainer.step(trainer.ready_sessions())
                assert metrics["online/promoted"] == 1.0 and metrics["online/reward_mean"] == 0.5
                assert "s1" not in proxy.sessions and "no-reward" in proxy.sessions
                v1 = _engine_weights(engine)
                assert not _same(v1, v0), "the promoted candidate serves"
                assert engine.weights_version == 1 and trainer.current == 1

                for sid, reward in (("s3", 0.0), ("s4", 1.0)):
                    await _chat(http, proxy, sid, "Say hi")
                    await _reward(http, proxy, sid, reward)
                metrics = await trainer.step(trainer.ready_sessions())
                assert metrics["online/promoted"] == 0.0  # 0.1 < 0.6 - 0.05: refused
                assert _same(_engine_weights(engine), v1) and engine.weights_version == 1  # still v1
                assert _same(trainer.worker.actor.named_weights(), v1)  # the policy went back too
                assert not trainer.worker.actor.optimizer.state

                r = await http.post(f"{proxy.url}/v1/admin/rollback", json={"version": 0})
                assert r.status_code == 200 and r.json()["current"] == 0, r.text
                assert _same(_engine_weights(engine), v0) and trainer.current == 0
                assert (
                    await http.post(f"{proxy.url}/v1/admin/rollback", json={"version": 7})
                ).status_code == 404
                assert (await http.post(f"{proxy.url}/v1/admin/rollback", json={"v": 1})).status_code == 400
                listing = (await http.get(f"{proxy.url}/v1/admin/versions")).json()
        assert [h["kind"] for h in listing["history"]] == ["baseline", "promoted", "refused", "rollback"]
        assert [v["version"] for v in listing["versions"]] == [0, 1] and listing["current"] == 0
        assert listing["sessions_trained"] == 4
        assert asked and all(name == proxy.model_name for name in asked)
        log_lines = (tmp_path / "run" / "promotions.jsonl").read_text().splitlines()
        assert [json.loads(line)["kind"] for line in log_lines] == [
            "baseline",
            "promoted",
            "refused",
            "rollback",
        ]
        proxy.sessions.ttl_s = 1e-6  # the unrewarded session expires: it is counted, never trained on
        assert "no-reward" not in proxy.sessions and trainer.sessions_dropped_untrained == 1
    finally:
        await trainer.close()
        await proxy.stop()
        await engine.stop()
        await store.close()


def test_the_admin_routes_need_the_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    class Control:
        def versions(self) -> dict[str, Any]:
            return {"current": 0, "versions": [{"version": 0}], "history": []}

        async def rollback(self, version: int) -> dict[str, Any]:
            raise KeyError(version)

    app = Starlette()
    add_admin_routes(app, Control(), "secret")
    with TestClient(app) as client:
        assert client.get("/v1/admin/versions").status_code == 401
        ok = client.get("/v1/admin/versions", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200 and ok.json()["current"] == 0
        big = client.post(
            "/v1/admin/rollback", content=b"x" * 5000, headers={"Authorization": "Bearer secret"}
        )
        assert big.status_code == 413


def test_jsonl_evaluator_checks_its_tasks(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "2+2?", "answer": "4"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: expected an object with 'messages' or 'prompt'"):
        jsonl_evaluator(tasks, lambda task, text: 1.0)
    with pytest.raises(ValueError, match="no evaluation tasks"):
        (tmp_path / "empty.jsonl").write_text("\n")
        jsonl_evaluator(tmp_path / "empty.jsonl", lambda task, text: 1.0)
    with pytest.raises(Exception, match="extra"):
        OnlineConfig.model_validate({"sesions_per_update": 2})
