"""Real clock: an abandoned attempt is ended by the watchdog while someone waits; two SQLiteStores
(as two processes would) share one file."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import agentloop.store as store_pkg
from agentloop.store.base import Store
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptStatus, RolloutConfig, RolloutStatus


@pytest.fixture(params=["memory", "sqlite", "http"])
async def real_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    backend: Store = (
        MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "s.db", poll_interval_s=0.05)
    )
    if request.param != "http":
        yield backend
    else:
        async with StoreServer(backend) as server, StoreClient(server.url) as client:
            yield client
    await backend.close()


@pytest.mark.parametrize(
    ("config", "status"),
    [
        (RolloutConfig(timeout_s=0.2, max_attempts=2), AttemptStatus.TIMEOUT),
        (RolloutConfig(unresponsive_s=0.2, max_attempts=2), AttemptStatus.UNRESPONSIVE),
    ],
)
async def test_abandoned_attempt_ends_while_waiting(
    real_store: Store, config: RolloutConfig, status: AttemptStatus
) -> None:
    rollout = await real_store.enqueue_rollout("x", config=config)
    for _ in range(2):  # both attempts are abandoned (a dead runner); nobody dequeues meanwhile
        attempted = await real_store.dequeue_rollout("dead-runner")
        assert attempted is not None
        start = time.monotonic()
        with anyio.fail_after(10):
            done = await real_store.wait_for_rollouts([rollout.rollout_id], timeout=0.6)
        assert 0.15 < time.monotonic() - start < 5
        attempt = await real_store.get_attempt(rollout.rollout_id, attempted.attempt.attempt_id)
        assert attempt.status is status
    assert [r.status for r in done] == [RolloutStatus.FAILED]
    assert (await real_store.get_rollout(rollout.rollout_id)).num_attempts == 2


async def test_two_sqlite_stores_share_one_file(tmp_path: Path) -> None:
    a, b = SQLiteStore(tmp_path / "shared.db"), SQLiteStore(tmp_path / "shared.db")
    try:
        ids = [(await a.enqueue_rollout(i)).rollout_id for i in range(20)]
        got: list[str] = []

        async def drain(store: SQLiteStore) -> None:
            while (attempted := await store.dequeue_rollout()) is not None:
                got.append(attempted.rollout_id)
                await store.update_attempt(
                    attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded"
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, a)
            tg.start_soon(drain, b)
        assert sorted(got) == sorted(ids)  # each rollout dequeued exactly once
        with anyio.fail_after(5):  # b sees a's commits (polling for other connections' writes)
            done = await b.wait_for_rollouts(ids, timeout=2)
        assert len(done) == 20
    finally:
        await a.close()
        await b.close()


def test_public_names() -> None:
    assert sorted(store_pkg.__all__) == ["MemoryStore", "SQLiteStore", "Store", "StoreClient", "StoreServer"]
    for name in store_pkg.__all__:
        assert getattr(store_pkg, name) is not None
    assert isinstance(MemoryStore(), store_pkg.Store)
