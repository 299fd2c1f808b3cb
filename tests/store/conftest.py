"""Store fixtures: the same suite runs on memory, SQLite and HTTP (a real server on a loopback port)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentloop.store.base import Store
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore


class FakeClock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "sqlite", "http"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    """Each backend with the fake clock; http serves a SQLiteStore through a real StoreServer."""
    if request.param == "memory":
        backend: Store = MemoryStore(clock=clock)
    else:
        backend = SQLiteStore(tmp_path / "store.db", clock=clock, poll_interval_s=0.05)
    if request.param != "http":
        yield backend
        await backend.close()
        return
    async with StoreServer(backend) as server:
        client = StoreClient(server.url, timeout=10)
        yield client
        await client.close()
    await backend.close()
