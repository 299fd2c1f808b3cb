"""Proxy test fixtures: the real SmolLM2 tokenizer (from the tiny model folder) and a MemoryStore."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from agentloop.types import AttemptedRollout

# The proxy runs on the caller's loop: asyncio's, or uvloop's under agentloop.event_loop.run (agentloop
# serve). Modules whose tests lean on the loop (timers, tasks, connections) run on both, with
#     anyio_backend = both_loops  (a module-level fixture override)
LOOPS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed"),
    ),
]


@pytest.fixture(params=LOOPS)
def both_loops(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@asynccontextmanager
async def running_proxy(engine: Any, store: Any = None, **kwargs: Any) -> AsyncIterator[Proxy]:
    """A Proxy on a loopback port, stopped on exit."""
    proxy = Proxy(engine, store if store is not None else MemoryStore(), **kwargs)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def new_attempt(store: Any, input: Any = None) -> AttemptedRollout:
    """Enqueue one rollout and dequeue its first attempt."""
    await store.enqueue_rollout(input if input is not None else {"q": 1})
    attempted = await store.dequeue_rollout("test-worker")
    assert attempted is not None
    return attempted


def attempt_url(proxy: Proxy, attempted: AttemptedRollout) -> str:
    return proxy.as_resource().get_base_url(attempted.rollout_id, attempted.attempt.attempt_id)


@pytest.fixture
async def oai() -> AsyncIterator[Callable[..., openai.AsyncOpenAI]]:
    """Makes AsyncOpenAI clients (no retries) and closes them while the event loop still runs."""
    clients: list[openai.AsyncOpenAI] = []

    def make(base_url: str, **kwargs: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
