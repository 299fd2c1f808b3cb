"""Issue 19, online training from app traffic: rewarded sessions become an update, the gate promotes a
candidate that scores well and refuses one that drops (the policy goes back), rollback over the admin
API, untrained sessions counted, the promotion log. Issue 42 item 5: group estimators are refused online,
``online/reward_mean`` is per session, each call trains at its recorded temperature and greedy sessions
are counted.

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

from agentloop.adapter import spans_to_triplets
from agentloop.engine.torch.engine import TorchEngine
from agentloop.errors import ConfigError
from agentloop.proxy.admin import add_admin_routes
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import SessionRecord, read_saved_sessions
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall, Reward
from trainer.algorithms import GROUP_ESTIMATORS
from trainer.online import (
    OnlineConfig,
    OnlineTrainer,
    jsonl_evaluator,
    online_trainer_config,
    session_metrics,
)


async def _chat(
    http: httpx.AsyncClient, proxy: Proxy, session: str, text: str, temperature: float = 1.0
) -> None:
    r = await http.post(
        f"{proxy.session_base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": temperature},
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


ADMIN = "online-admin-key"


@pytest.mark.e2e
async def test_sessions_train_the_gate_promotes_or_refuses_and_rollback_restores(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    scores = iter([0.5, 0.6, 0.1])  # v0's baseline, a better candidate, one that drops past the margin
    asked: list[str] = []

    async def evaluate(base_url: str, model: str, api_key: str | None) -> float:
        async with httpx.AsyncClient() as http:  # the candidate engine answers, not the serving one
            # the gate's private proxy has a random key (issue 44, finding 7): nobody else may ask it
            assert (
                api_key and len(api_key) >= 32 and (await http.get(f"{base_url}/models")).status_code == 401
            )
            listed = await http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"})
            asked.append(listed.json()["data"][0]["id"])
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
    proxy = Proxy(engine, store, admin_key=ADMIN)
    trainer = OnlineTrainer(proxy, config, online, tiny_model_dir, tmp_path / "run", evaluate=evaluate)
    add_admin_routes(proxy.app, trainer, proxy.admin_key, bound_host=proxy.host)
    batches: list[Any] = []
    update = trainer.worker.update

    def recording_update(batch: Any) -> dict[str, float]:  # the real update; the test sees its batch
        batches.append(batch)
        return update(batch)

    trainer.worker.update = recording_update  # type: ignore[method-assign]
    v0 = _engine_weights(engine)
    try:
        await proxy.start()
        await trainer.start()
        async with httpx.AsyncClient(timeout=60) as http:
            admin = {"Authorization": f"Bearer {ADMIN}"}
            with anyio.fail_after(120):
                # s1: two calls sampled at T = 0.7, reward 1; s2: one greedy call (T = 0), reward 0
                await _chat(http, proxy, "s1", "Say hi", temperature=0.7)
                await _chat(http, proxy, "s1", "Say more", temperature=0.7)
                await _reward(http, proxy, "s1", 1.0)
                await _chat(http, proxy, "s2", "Say hi", temperature=0.0)
                await _reward(http, proxy, "s2", 0.0)
                await _chat(http, proxy, "no-reward", "Say hi")
                assert trainer.ready_sessions() == ["s1", "s2"]  # rewarded ones only
                metrics = await trainer.step(trainer.ready_sessions())
                assert metrics["online/promoted"] == 1.0
                # one vote per session: (1 + 0) / 2 = 0.5; per call it was (1 + 1 + 0) / 3 = 0.667
                assert metrics["online/reward_mean"] == 0.5
                assert metrics["online/greedy_sessions"] == 1.0 and metrics["online/greedy_calls"] == 1.0
                assert trainer.versions()["sessions_greedy"] == 1
                # each row trains at its recorded temperature; the greedy row's logits are divided by 1
                [batch] = batches
                trained = batch.response_mask.bool()  # (B, R); rows: s1's two calls, s2's one

                def per_row(t: torch.Tensor) -> list[float]:  # (B, R) -> each row's one value, sorted
                    return sorted(round(t[i][trained[i]].unique().item(), 4) for i in range(len(t)))

                assert per_row(batch.temperatures) == [0.0, 0.7, 0.7]
                assert per_row(batch.logit_temperatures()) == [0.7, 0.7, 1.0]
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

                r = await http.post(f"{proxy.url}/v1/admin/rollback", json={"version": 0}, headers=admin)
                assert r.status_code == 200 and r.json()["current"] == 0, r.text
                assert _same(_engine_weights(engine), v0) and trainer.current == 0
                assert (
                    await http.post(f"{proxy.url}/v1/admin/rollback", json={"version": 7}, headers=admin)
                ).status_code == 404
                bad = await http.post(f"{proxy.url}/v1/admin/rollback", json={"v": 1}, headers=admin)
                assert bad.status_code == 400
                listing = (await http.get(f"{proxy.url}/v1/admin/versions", headers=admin)).json()
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
        await proxy.sessions.journal.flush()  # type: ignore[union-attr]
        trained = {  # the store keeps what each update trained on (issue 46): id -> (update, outcome)
            s.session_id.partition("#")[0]: (s.trained.update, s.trained.outcome, s.trained.version)
            for s in read_saved_sessions(tmp_path / "serve.db")[1]
            if s.trained is not None and s.trained.run == str(trainer.run_dir)
        }
        assert trained == {
            "s1": (1, "promoted", 1), "s2": (1, "promoted", 1), "s3": (2, "rejected", None), "s4": (2, "rejected", None)
        }  # fmt: skip
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
        json_body = {"Authorization": "Bearer secret", "Content-Type": "application/json"}
        big = client.post("/v1/admin/rollback", content=b"x" * 5000, headers=json_body)
        assert big.status_code == 413
        text = client.post(
            "/v1/admin/rollback", content=b'{"version": 0}', headers={"Authorization": "Bearer secret"}
        )
        assert text.status_code == 415  # not declared JSON: what a web page sends without asking
    off = Starlette()
    add_admin_routes(off, Control(), None)  # no admin key: the routes are off
    with TestClient(off) as client:
        assert client.get("/v1/admin/versions").status_code == 403


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


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("n", [None, 4])
def test_group_estimators_are_refused_online(tiny_model_dir: Path, estimator: str, n: int | None) -> None:
    """Issue 42 item 5 (repro r11_online_grpo.py): grpo with rollout.n=4 was accepted online, where every
    session is a group of one: all advantages 0, updates that change nothing."""
    raw: dict[str, Any] = {"algorithm": {"adv_estimator": estimator}}
    if n is not None:
        raw["actor_rollout_ref"] = {"rollout": {"n": n}}
    with pytest.raises(ConfigError) as info:
        online_trainer_config(raw, str(tiny_model_dir), "cpu")
    message = str(info.value)
    assert f"algorithm.adv_estimator={estimator!r}" in message and "no groups" in message, message
    assert "set algorithm.adv_estimator to one of" in message and "or leave it out" in message
    assert "gae" in message and "reinforce_plus_plus," in message  # others registered by tests may join
    for usable in ("reinforce_plus_plus", "gae"):
        config, _ = online_trainer_config(
            {"algorithm": {"adv_estimator": usable}}, str(tiny_model_dir), "cpu"
        )
        assert config.algorithm.adv_estimator == usable


def _session(sid: str, calls: list[float], rewards: list[tuple[int, float]]) -> SessionRecord:
    """A session record as the proxy keeps it: calls sampled at the given temperatures, each reward
    posted after the given number of calls."""
    rec = SessionRecord(sid)
    for i, temperature in enumerate(calls):
        call = LLMCall(prompt_ids=[1, 2, 3 + i], response_ids=[10 + i, 11], response_logprobs=[-1.0, -1.0],
                       sampling={"temperature": temperature})  # fmt: skip
        rec.call_json.append(call.model_dump_json().encode())
    for after, value in rewards:
        rec.rewards.append(Reward(value=value))
        rec.reward_after.append(after)
    return rec


def test_session_metrics_give_each_session_one_vote() -> None:
    """Issue 42 item 5: online/reward_mean averaged the triplets' rewards (one per call).

    Session A: two calls at T=0.7, reward 0.5 after the first and 1.0 after the second (total 1.5);
    session B: one greedy call (T=0), reward -1. Per session: (1.5 + -1) / 2 = 0.25. Per call with
    per_call credit (discount 1) the triplets hold 0.5 + 1.0 = 1.5, 1.0 and -1: (1.5 + 1 - 1) / 3 = 0.5.
    """
    a = _session("a", [0.7, 0.7], [(1, 0.5), (2, 1.0)])
    b = _session("b", [0.0], [(1, -1.0)])
    triplets = [t for rec in (a, b) for t in spans_to_triplets(rec.spans(), "per_call").triplets]
    assert [t.reward for t in triplets] == [1.5, 1.0, -1.0]  # what the old per-call mean averaged
    assert session_metrics(triplets) == {
        "online/reward_mean": 0.25,
        "online/greedy_sessions": 1.0,
        "online/greedy_calls": 1.0,
    }
