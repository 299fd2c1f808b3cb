"""Reliability fixtures: the real SmolLM2 tokenizer (for EchoEngine) and a proxy on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentloop.proxy.server import Proxy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@asynccontextmanager
async def running_proxy(engine: Any, store: Any, **kwargs: Any) -> AsyncIterator[Proxy]:
    """A Proxy on a loopback port, stopped on exit."""
    proxy = Proxy(engine, store, **kwargs)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
