"""A Tinker server on the tiny model, started once per test module (in a thread of its own,
with its own event loop: the SDK's clients block, as a user's script does)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

KEY = "tml-agentloop-test-key"
MODEL_NAME = "tiny-smollm2"


@dataclass
class RunningServer:
    url: str
    service: Any  # agentloop.tinker.TinkerService
    model_dir: Path


@pytest.fixture(scope="module")
def tinker_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from agentloop.commands.tinker import trainer_parts
    from agentloop.tinker import TinkerServer

    state_dir = tmp_path_factory.mktemp("tinker-state")
    started = threading.Event()
    out: dict[str, Any] = {}

    async def main() -> None:
        server = TinkerServer(
            str(tiny_model_dir), trainer_parts(), [SecretStr(KEY)], port=0, device="cpu",
            model_name=MODEL_NAME, state_dir=state_dir, engine_kwargs={"max_batch_size": 8},
            max_models=64,  # the tests' fixtures keep their training models; the cap has a test of its own
        )  # fmt: skip
        try:
            out["url"] = await server.start()
            out["service"] = server.service
            out["stop"] = stop = asyncio.Event()
            out["loop"] = asyncio.get_running_loop()
        except BaseException as exc:
            out["error"] = exc
            raise
        finally:
            started.set()
        await stop.wait()
        await server.stop()

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="tinker-test-server", daemon=True)
    thread.start()
    assert started.wait(120), "the Tinker server did not start within 120 s"
    if "error" in out:
        raise out["error"]
    yield RunningServer(out["url"], out["service"], tiny_model_dir)
    out["loop"].call_soon_threadsafe(out["stop"].set)
    thread.join(30)


@pytest.fixture(scope="module")
def service_client(tinker_server: RunningServer) -> Iterator[Any]:
    tinker = pytest.importorskip(
        "tinker", reason="the tinker SDK is not installed (pip install -e '.[tinker]')"
    )
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
    yield client
    client.close("success").result()
