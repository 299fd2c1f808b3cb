"""The servers hold under attack (issue 16): each attack of tests/reliability/attacks.py runs against a
StoreServer (or a Proxy with an echo engine) in its own process while a legitimate client keeps
working; the client is answered within 2 s, the server's memory stays bounded and nothing
legitimate is lost."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from agentloop.proxy.server import Proxy
from tests.reliability.attacks import (
    PROXY_ATTACKS,
    STORE_ATTACKS,
    Attack,
    hostile_tool_input,
    measure,
    proxy_process,
    store_process,
)
from tests.reliability.report import record


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "attack"), STORE_ATTACKS, ids=[a.__name__ for _, a in STORE_ATTACKS])
async def test_the_store_holds(tmp_path: Path, name: str, attack: Attack) -> None:
    async with store_process(tmp_path) as target:
        row, detail = await measure(target, name, attack)
    record("attack", **row, detail=detail)
    assert row["held"] and row["lost"] == 0, detail


@pytest.mark.skipif(
    "limits" not in inspect.signature(Proxy).parameters, reason="the proxy has no connection limits yet"
)
@pytest.mark.e2e
@pytest.mark.parametrize(("name", "attack"), PROXY_ATTACKS, ids=[a.__name__ for _, a in PROXY_ATTACKS])
async def test_the_proxy_holds(tmp_path: Path, tiny_model_dir: Path, name: str, attack: Attack) -> None:
    async with proxy_process(tmp_path, tiny_model_dir) as target:
        row, detail = await measure(target, name, attack)
    record("attack", **row, detail=detail)
    assert row["held"] and row["lost"] == 0, detail


async def test_hostile_tool_input_neither_stalls_the_loop_nor_writes(tmp_path: Path) -> None:
    row, detail = await hostile_tool_input(tmp_path)
    record("attack", **row, detail=detail)
    assert row["held"] and row["lost"] == 0, detail
