"""Issue 44 finding 1: two rewards of 1.7e308 on one session summed to inf, building the sample raised,
the exception left ``OnlineTrainer.run`` and ``serve --train`` exited. Now such a reward is a 400 at the
reward route, and an update that raises anyway is logged and counted (``updates_failed``): the policy
goes back to the promoted weights, the proxy keeps serving and the next update trains.

Real components: a Proxy over a SQLiteStore with a TorchEngine (the tiny model with the real tokenizer)
and the real TrainerWorker; the first update is made to raise (the fault), the second is the real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentloop.engine.torch.engine import TorchEngine
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import read_saved_sessions
from agentloop.store.sqlite import SQLiteStore
from trainer.online import OnlineTrainer, online_trainer_config

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 1.0}


@pytest.mark.timeout(300)
async def test_a_failed_update_is_counted_and_the_server_keeps_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config, online = online_trainer_config(
        {"online": {"sessions_per_update": 1, "settle_s": 0, "poll_s": 0.05, "max_updates": 1},
         "data": {"max_prompt_length": 64, "max_response_length": 8}},
        str(tiny_model_dir), "cpu",
    )  # fmt: skip
    engine = TorchEngine(tiny_model_dir, device="cpu")
    store = SQLiteStore(tmp_path / "serve.db")
    proxy = Proxy(engine, store)
    trainer = OnlineTrainer(proxy, config, online, tiny_model_dir, tmp_path / "run")
    update = trainer.worker.update
    calls: list[int] = []

    def failing_once(batch: Any) -> dict[str, float]:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("boom: the first update fails")
        return update(batch)

    trainer.worker.update = failing_once  # type: ignore[method-assign]
    try:
        await proxy.start()
        base = proxy.session_base_url
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            # the review's attack: two rewards of 1.7e308 on one session; each is refused now
            s0 = {"X-Session-Id": "huge"}
            assert (await http.post("/chat/completions", json=CHAT, headers=s0)).status_code == 200
            for _ in range(2):
                resp = await http.post("/sessions/huge/reward", json={"value": 1.7e308})
                assert resp.status_code == 400 and "within +-1e+06" in resp.text, resp.text
            async with anyio.create_task_group() as tg:
                await tg.start(trainer.run)
                with anyio.fail_after(240):
                    for sid in ("s1", "s2"):
                        headers = {"X-Session-Id": sid}
                        assert (
                            await http.post("/chat/completions", json=CHAT, headers=headers)
                        ).status_code == 200
                        assert (
                            await http.post(f"/sessions/{sid}/reward", json={"value": 1.0})
                        ).status_code == 200
                        while len(calls) < (1 if sid == "s1" else 2):
                            await anyio.sleep(0.05)
                    # the first update failed, was counted, and the proxy went on serving
                    assert trainer.updates_failed == 1
                    ok = await http.post("/chat/completions", json=CHAT, headers={"X-Session-Id": "after"})
                    assert ok.status_code == 200
            # run() returned after the real update (max_updates=1), not with the failure
        assert trainer.updates == 1 and trainer.versions()["updates_failed"] == 1
        assert trainer.sessions_trained == 2
        await proxy.sessions.journal.flush()  # type: ignore[union-attr]
        outcomes = {
            s.session_id.partition("#")[0]: (s.trained.update, s.trained.outcome, s.trained.version)
            for s in read_saved_sessions(tmp_path / "serve.db")[1]
            if s.trained is not None
        }
        assert outcomes == {"s1": (1, "failed", None), "s2": (2, "promoted", 1)}  # kept, marked (issue 46)
    finally:
        await trainer.close()
        await proxy.stop()
        await engine.stop()
        await store.close()
