"""Function tools (agentloop.tools.function): return forms, threads, and worker processes killed at
the deadline."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agentloop.errors import ToolDefinitionError
from agentloop.tools import (
    FunctionTool,
    ToolRegistry,
    ToolResponse,
    ToolResult,
    execute_tool_call,
    function_tool,
    run_tool,
)
from tests.loop_watch import watch_event_loop
from tests.tools.fixtures import add, thread_probe

pytestmark = pytest.mark.anyio  # parametrized async tests need the marker at collection time


# ---------------------------------------------------------------- function tools


def test_decorated_function_stays_callable() -> None:
    assert add(2, b=3) == 5
    assert isinstance(add, FunctionTool) and add.__name__ == "add" and add.__wrapped__(1) == 1
    assert "Add two integers." in (add.__doc__ or "")


class Answer(BaseModel):
    value: int


@function_tool
def returns(kind: str) -> Any:
    """Return each supported form."""
    forms: dict[str, Any] = {
        "str": "plain",
        "dict": {"a": 1, "b": [True, None]},
        "list": [1, "x"],
        "none": None,
        "dated": {"when": datetime.date(2024, 1, 2)},
        "model": Answer(value=4),
        "response": ToolResponse(text="r", images=["https://x/i.png"]),
        "pair": ("ok", 1),
        "triple": ({"n": 2}, 0.5, {"hits": 3}),
        "pair_none": (ToolResponse(text="t"), None),
        "bad_tuple": ("a", 1, {}, 2),
        "bad_reward": ("a", "high"),
        "bad_metrics": ("a", 1.0, ["x"]),
        "unshowable": object(),
    }
    return forms[kind]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("str", ToolResult(response=ToolResponse(text="plain"))),
        ("dict", ToolResult(response=ToolResponse(text='{"a": 1, "b": [true, null]}'))),
        ("list", ToolResult(response=ToolResponse(text='[1, "x"]'))),
        ("none", ToolResult(response=ToolResponse(text="null"))),
        ("dated", ToolResult(response=ToolResponse(text='{"when": "2024-01-02"}'))),
        ("model", ToolResult(response=ToolResponse(text='{"value":4}'))),
        ("response", ToolResult(response=ToolResponse(text="r", images=["https://x/i.png"]))),
        ("pair", ToolResult(response=ToolResponse(text="ok"), reward=1.0)),
        ("triple", ToolResult(response=ToolResponse(text='{"n": 2}'), reward=0.5, metrics={"hits": 3})),
        ("pair_none", ToolResult(response=ToolResponse(text="t"), reward=None)),
    ],
)
async def test_return_forms(kind: str, expected: ToolResult) -> None:
    assert await run_tool(returns, {"kind": kind}) == expected


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("bad_tuple", r"tuple of 4 items; expected \(response, reward\) or \(response, reward, metrics\)"),
        ("bad_reward", "returned reward 'high'; expected a number or None"),
        ("bad_metrics", r"returned metrics \['x'\]; expected a dict"),
        ("unshowable", "returned object, which cannot be shown to the model"),
    ],
)
async def test_bad_return_forms_raise_clearly(kind: str, message: str) -> None:
    with pytest.raises(ToolDefinitionError, match=message):
        await run_tool(returns, {"kind": kind})


async def test_sync_tools_run_in_a_worker_thread_async_tools_in_the_loop() -> None:
    result = await run_tool(thread_probe, None)
    assert result.response.text is not None
    assert str(threading.get_ident()) not in result.response.text  # ran elsewhere

    @function_tool
    async def probe_async() -> dict[str, int]:
        return {"thread": threading.get_ident()}

    result = await run_tool(probe_async, "{}")
    assert result.response.text == f'{{"thread": {threading.get_ident()}}}'


async def test_positional_only_parameters_are_passed_by_position() -> None:
    @function_tool
    def power(base: int, /, exp: int = 2) -> int:
        return base**exp

    assert (await run_tool(power, '{"base": 3, "exp": "3"}')).response.text == "27"


# ---------------------------------------------------------------- deadlines that hold (issue 16)


def big_power(exponent: int) -> dict[str, int]:
    """``10 ** exponent`` in one C-level pow, which holds the GIL from start to end (10**10**8: minutes)."""
    if exponent < 0:
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    return {"bits": (10**exponent).bit_length(), "pid": os.getpid()}


async def _call_while_ticking(
    registry: ToolRegistry, name: str, args: dict[str, Any], timeout_s: float
) -> tuple[ToolResult, float, float]:
    """The call's result, its wall time, and the longest gap of a coroutine ticking every 5 ms meanwhile."""
    async with watch_event_loop() as gaps:  # a stall right after the call shows up too
        start = time.monotonic()
        result = await execute_tool_call(registry, name, args, timeout_s=timeout_s)
        elapsed = time.monotonic() - start
    return result, elapsed, max(gaps)


@pytest.mark.timeout(120)
async def test_a_process_tool_past_its_deadline_is_killed_and_the_loop_keeps_ticking() -> None:
    """issue 16: a sync tool in a thread cannot be stopped, and a GIL-holding one stalls the loop;
    run_in="process" kills the worker at the deadline and the event loop never waits on it."""
    tool = FunctionTool(big_power, run_in="process")
    registry = ToolRegistry([tool])
    warm = await execute_tool_call(registry, "big_power", {"exponent": 10}, timeout_s=60)  # starts the worker
    assert not warm.is_error, warm
    pid = json.loads(warm.response.text or "")["pid"]
    assert pid != os.getpid() and json.loads(warm.response.text or "")["bits"] == 34

    result, elapsed, gap = await _call_while_ticking(
        registry, "big_power", {"exponent": 10**8}, timeout_s=1.0
    )
    assert result.metrics == {"error": "timeout"}, result
    assert result.response.text == "Error: tool 'big_power' did not finish within 1 s"
    assert 1.0 <= elapsed < 2.0, elapsed  # ends at the deadline (slack for a loaded 2-core machine)
    assert gap < 0.5, gap  # the loop kept ticking (a thread running this pow: no tick for minutes)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker was killed and reaped, not left computing
    again = await execute_tool_call(registry, "big_power", {"exponent": 3}, timeout_s=60)
    assert (
        json.loads(again.response.text or "")["bits"] == 10
        and json.loads(again.response.text or "")["pid"] != pid
    )


async def test_process_tools_report_exceptions_and_check_their_definition(tmp_path: Path) -> None:
    registry = ToolRegistry([FunctionTool(big_power, run_in="process")])
    failed = await execute_tool_call(registry, "big_power", {"exponent": -1}, timeout_s=60)
    assert failed.metrics == {"error": "tool_exception"} and "ValueError: exponent must be >= 0" in (
        failed.response.text or ""
    )

    def local(x: int) -> int:
        return x

    async def coro(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="needs a function defined at module level"):
        function_tool(run_in="process")(local)
    with pytest.raises(ToolDefinitionError, match="run_in='process' is for sync functions"):
        FunctionTool(coro, run_in="process")
    with pytest.raises(ToolDefinitionError, match="run_in must be 'thread' or 'process', got 'fork'"):
        FunctionTool(big_power, run_in="fork")  # type: ignore[arg-type]
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class: tests.tools.fixtures.add\n    config: {run_in: process, timeout_s: 30}\n"
    )
    loaded = ToolRegistry.from_yaml(path)
    assert isinstance(loaded.get("add"), FunctionTool) and loaded.get("add").run_in == "process"  # type: ignore[attr-defined]
    assert (await execute_tool_call(loaded, "add", {"a": 2, "b": 3})).response.text == "5"


def allocate(megabytes: int) -> int:
    """Allocates ``megabytes`` MiB and returns how many bytes it got."""
    return len(bytearray(megabytes * 1024 * 1024))


@pytest.mark.skipif(sys.platform != "linux", reason="max_memory_mb is RLIMIT_AS, enforced on Linux")
async def test_a_process_tool_over_its_memory_cap_fails_and_its_worker_lives_on() -> None:
    registry = ToolRegistry([FunctionTool(allocate, run_in="process", max_memory_mb=200)])
    small = await execute_tool_call(registry, "allocate", {"megabytes": 50}, timeout_s=60)
    assert small.response.text == str(50 * 1024 * 1024), small
    big = await execute_tool_call(registry, "allocate", {"megabytes": 1000}, timeout_s=60)
    assert big.metrics == {"error": "tool_exception"} and "raised MemoryError" in (big.response.text or ""), (
        big
    )
    again = await execute_tool_call(registry, "allocate", {"megabytes": 150}, timeout_s=60)
    assert again.response.text == str(150 * 1024 * 1024), again  # the cap is per call, the worker lived on
    with pytest.raises(ToolDefinitionError, match="max_memory_mb must be an int >= 1 with run_in='process'"):
        FunctionTool(allocate, max_memory_mb=100)
