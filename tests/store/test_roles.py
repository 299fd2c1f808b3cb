"""Store roles (issue 16): the admin key (the trainer) may do everything; a runner key may read,
dequeue, and write spans and status only for attempts it dequeued. Each violation is a 403 that says
the rule."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop.errors import InvalidRequestError, StoreUnavailableError
from agentloop.resources import LLM, Resources
from agentloop.store.client import StoreClient
from agentloop.store.server import StoreServer, runner_key
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout, AttemptStatus, Log, Reward, Span

ADMIN, R1_KEY = "admin-key", "runner-one-key"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[StoreServer, SQLiteStore]]:
    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store, admin_key=ADMIN, runner_keys={"r1": R1_KEY}) as server:
        yield server, store
    await store.close()


async def _setup(
    server: StoreServer,
) -> tuple[StoreClient, StoreClient, StoreClient, AttemptedRollout, AttemptedRollout]:
    admin = StoreClient(server.url, api_key=ADMIN)
    r1 = StoreClient(server.url, api_key=R1_KEY)
    r2 = StoreClient(server.url, api_key=server.runner_key("r2"))  # derived from the admin key
    await admin.enqueue_rollout({"task": "a"})
    await admin.enqueue_rollout({"task": "b"})
    mine, theirs = await r1.dequeue_rollout("w1"), await r2.dequeue_rollout()
    assert mine is not None and theirs is not None
    return admin, r1, r2, mine, theirs


def _reward(a: AttemptedRollout, value: float = 1.0) -> Span:
    return Span(rollout_id=a.rollout_id, attempt_id=a.attempt.attempt_id, payload=Reward(value=value))


async def test_a_runner_writes_only_into_attempts_it_dequeued(served: Any) -> None:
    server, _ = served
    admin, r1, r2, mine, theirs = await _setup(server)
    try:
        assert mine.attempt.worker_id == "r1/w1" and theirs.attempt.worker_id == "r2"
        with pytest.raises(
            InvalidRequestError, match=r"runner 'r1' may write only to attempts it dequeued.*'r2'"
        ):
            await r1.add_span(_reward(theirs, 99.0))
        with pytest.raises(InvalidRequestError, match="runner 'r1' may write only to attempts it dequeued"):
            await r1.update_attempt(theirs.rollout_id, theirs.attempt.attempt_id, status=AttemptStatus.FAILED)
        with pytest.raises(InvalidRequestError, match="may write only"):
            await r1.update_attempt(theirs.rollout_id, theirs.attempt.attempt_id, heartbeat=True)
        assert await admin.query_spans(theirs.rollout_id) == []
        assert (await admin.get_attempt(theirs.rollout_id, theirs.attempt.attempt_id)).status == "preparing"
        # its own attempt: spans, heartbeats and status; reads of its own rollouts only (issue 44)
        await r1.add_span(_reward(mine))
        await r1.update_attempt(mine.rollout_id, mine.attempt.attempt_id, heartbeat=True)
        await r1.update_attempt(mine.rollout_id, mine.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
        assert (await r1.get_rollout(mine.rollout_id)).status == "succeeded"
        with pytest.raises(InvalidRequestError, match="may read only rollouts it dequeued"):
            await r1.get_rollout(theirs.rollout_id)
        assert len(await r1.query_spans(mine.rollout_id)) == 1
        await r2.add_span(_reward(theirs))  # the other runner writes into its own
    finally:
        for c in (admin, r1, r2):
            await c.close()


async def test_a_runner_may_not_enqueue_cancel_or_replace_resources(served: Any) -> None:
    server, _ = served
    admin, r1, r2, mine, theirs = await _setup(server)
    try:
        await admin.add_resources(
            Resources(items={"llm": LLM(base_url="http://good/v1", model="m", api_key="EMPTY")})
        )
        evil = Resources(items={"llm": LLM(base_url="http://evil/v1", model="m", api_key="EMPTY")})
        with pytest.raises(
            InvalidRequestError, match=r"runner 'r1' may not add or replace resources .*admin key"
        ):
            await r1.add_resources(evil)
        with pytest.raises(InvalidRequestError, match="runner 'r2' may not cancel rollouts"):
            await r2.cancel_rollout(mine.rollout_id)
        with pytest.raises(InvalidRequestError, match="runner 'r1' may not enqueue rollouts"):
            await r1.enqueue_rollout({"task": "injected"})
        latest = await r1.get_latest_resources()
        assert latest is not None and latest.version == 1
        assert latest.model_dump()["items"]["llm"]["base_url"] == "http://good/v1"
        assert (await admin.get_rollout(mine.rollout_id)).status == "running"
        assert len(await admin.list_rollouts()) == 2
        # the admin may do all of it
        await admin.add_span(_reward(theirs))
        await admin.cancel_rollout(theirs.rollout_id)
    finally:
        for c in (admin, r1, r2):
            await c.close()


async def test_violations_are_403_with_the_rule(served: Any) -> None:
    server, _ = served
    admin, r1, r2, _mine, theirs = await _setup(server)
    try:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"authorization": f"Bearer {R1_KEY}"}
        ) as http:
            cases: list[tuple[str, str, Any]] = [
                ("POST", "/v1/resources", {"items": {}}),
                ("POST", f"/v1/rollouts/{theirs.rollout_id}/cancel", None),
                ("POST", "/v1/rollouts", {"input": 1}),
                ("POST", f"/v1/rollouts/{theirs.rollout_id}/attempts/{theirs.attempt.attempt_id}", {"status": "failed"}),
                ("POST", "/v1/spans", _reward(theirs).model_dump(mode="json")),
            ]  # fmt: skip
            for method, path, body in cases:
                resp = await http.request(method, path, json=body)
                assert resp.status_code == 403, (path, resp.text)
                err = resp.json()["error"]
                assert err["type"] == "forbidden" and "runner 'r1' may" in err["message"]
    finally:
        for c in (admin, r1, r2):
            await c.close()


async def test_ownership_survives_a_server_restart(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store, admin_key=ADMIN) as server:
        admin, r1 = (
            StoreClient(server.url, api_key=ADMIN),
            StoreClient(server.url, api_key=server.runner_key("r1")),
        )
        await admin.enqueue_rollout({"task": "a"})
        mine = await r1.dequeue_rollout("w")
        assert mine is not None
        await admin.close()
        await r1.close()
    async with StoreServer(store, admin_key=ADMIN) as server:  # a new server: its owner cache is empty
        r1, r2 = (StoreClient(server.url, api_key=runner_key(ADMIN, n)) for n in ("r1", "r2"))
        with pytest.raises(InvalidRequestError, match="dequeued by runner 'r1'"):
            await r2.add_span(_reward(mine))
        await r1.add_span(_reward(mine))
        await r1.close()
        await r2.close()
    await store.close()


async def test_runner_keys_cannot_be_forged_and_api_key_is_the_admin_key(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store, api_key=ADMIN) as server:
        forged = runner_key("not-the-admin-key", "r1")
        tampered = runner_key(ADMIN, "r1").replace("runner.r1.", "runner.r2.")
        for key in (forged, tampered, "runner.r1", "runner..", ADMIN + "x"):
            async with StoreClient(server.url, api_key=key) as bad:
                with pytest.raises(StoreUnavailableError, match="401"):
                    await bad.dequeue_rollout()
        async with StoreClient(server.url, api_key=ADMIN) as admin:  # api_key as before: the admin
            await admin.add_resources(Resources(items={}))
            await admin.enqueue_rollout({"x": 1})
            await admin.add_span(
                Span(
                    rollout_id=(a := await admin.dequeue_rollout()).rollout_id,  # type: ignore[union-attr]
                    attempt_id=a.attempt.attempt_id,  # type: ignore[union-attr]
                    payload=Log(message="admin writes anywhere"),
                )
            )
    await store.close()


def test_key_config_is_checked() -> None:
    store: Any = object()
    with pytest.raises(InvalidRequestError, match="repeats another key"):
        StoreServer(store, admin_key="same", runner_keys={"r1": "same"})
    with pytest.raises(InvalidRequestError, match="runner name"):
        StoreServer(store, admin_key="a", runner_keys={"bad/name": "k"})
    with pytest.raises(InvalidRequestError, match="pass only admin_key"):
        StoreServer(store, api_key="a", admin_key="b")
    with pytest.raises(InvalidRequestError, match="has none"):
        StoreServer(store).runner_key("r1")
    from pydantic import SecretStr

    server = StoreServer(store, admin_key=SecretStr("s"), runner_keys={"r1": SecretStr("k")})
    assert server.runner_key("r1") == runner_key("s", "r1")


async def test_a_runner_with_a_runner_key_runs_rollouts_end_to_end(tmp_path: Path) -> None:
    from agentloop.agent import emit_reward, rollout
    from agentloop.runner import Runner

    @rollout
    async def agent(task: dict[str, Any], llm: Any) -> float:
        await emit_reward(0.5, name="turn")
        return float(task["reward"])

    store = SQLiteStore(tmp_path / "s.db")
    async with StoreServer(store, admin_key=ADMIN) as server:
        async with StoreClient(server.url, api_key=ADMIN) as admin:
            ids = [(await admin.enqueue_rollout({"reward": r})).rollout_id for r in (1.0, 0.0, 1.0)]
            async with StoreClient(server.url, api_key=server.runner_key("gpu-node-1")) as client:
                stats = await Runner(agent, client, worker_id="w0", concurrency=2).run(max_rollouts=3)
            assert stats.succeeded == 3
            done = await admin.wait_for_rollouts(ids, timeout=10)
            assert [r.status for r in done] == ["succeeded"] * 3
            for rid in ids:
                (attempt,) = await admin.list_attempts(rid)
                assert attempt.worker_id == "gpu-node-1/w0"
                rewards = [
                    s.payload.value for s in await admin.query_spans(rid) if s.payload.kind == "reward"
                ]
                assert len(rewards) == 2
    await store.close()
