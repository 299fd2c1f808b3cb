"""Shared fixtures: async tests run on anyio (asyncio backend), a tiny model with the real tokenizer."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    # Every `async def` test runs under anyio without a per-test marker. Marking here, before the
    # items exist, lets anyio's own hook see the marker (parametrized tests included).
    if collector.funcnamefilter(name) and inspect.iscoroutinefunction(obj):  # type: ignore[attr-defined]
        pytest.mark.anyio(obj)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn and ray need asyncio


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised Llama of SmolLM2's architecture (2 small layers) with the real
    SmolLM2 tokenizer and chat template, saved as a Hugging Face folder."""
    from agentloop.engine.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
