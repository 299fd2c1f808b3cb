"""Shared fixtures: async tests run on anyio (asyncio backend), a tiny model with the real tokenizer."""

from __future__ import annotations

import gc
import inspect
from collections.abc import Iterator
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


@pytest.fixture(autouse=True)
def _collect_clients_outside_the_loop() -> Iterator[None]:
    """After every test, collect its garbage while no event loop runs. openai's async clients that a
    test (like a real agent) never closed schedule their own ``aclose`` on whatever loop runs when
    they are collected; collected during a later test, that task touches the earlier test's closed
    loop and fails the later test. Sync tests count too: they run loops of their own (``anyio.run``,
    ``Trainer.fit``)."""
    yield
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_outlives_the_tests() -> None:
    """Before a module's tests, freeze what is alive (imports: torch, transformers, ray, the packages;
    session fixtures): the collector never scans it again. The full collection after every test (above)
    then costs ~0 s instead of ~0.4 s on 2 cores (6 of the suite's 15 minutes). Everything the tests and
    module fixtures create is still collected; the previous module's fixtures are gone by now."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray with 2 CPUs for the module's tests (joins one already running, and leaves it)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised Llama of SmolLM2's architecture (2 small layers) with the real
    SmolLM2 tokenizer and chat template, saved as a Hugging Face folder."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
