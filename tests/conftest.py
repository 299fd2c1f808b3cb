"""Shared fixtures: async tests run on anyio (asyncio backend), a tiny model with the real tokenizer."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every `async def` test runs under anyio without a per-test marker.
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and inspect.iscoroutinefunction(fn):
            item.add_marker(pytest.mark.anyio)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn and ray need asyncio


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised Llama of SmolLM2's architecture (2 small layers) with the real
    SmolLM2 tokenizer and chat template, saved as a Hugging Face folder."""
    from agentloop.engine.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
