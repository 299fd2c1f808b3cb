"""Tools: responses, return forms, threads, lifecycle, registries (also from YAML), safe calls."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog.testing
from pydantic import BaseModel, ValidationError

from agentloop.errors import ToolArgumentError, ToolDefinitionError, ToolNotFoundError
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
from tests.tool_fixtures import Counter, Exploding, add, thread_probe

YAML = Path(__file__).parent / "data" / "tools.yaml"
pytestmark = pytest.mark.anyio  # parametrized async tests need the marker at collection time


# ---------------------------------------------------------------- ToolResponse / ToolResult


def test_tool_response_needs_text_or_images() -> None:
    assert ToolResponse(text="").to_openai_content() == ""
    with pytest.raises(ValidationError, match="needs text"):
        ToolResponse()
    with pytest.raises(ValidationError, match="needs text"):
        ToolResponse(images=[])
    with pytest.raises(ValidationError, match=r"images\[1\] must be an http\(s\) URL"):
        ToolResponse(images=["https://x/a.png", "not an image!"])
    both = ToolResponse(text="see", images=["https://x/a.png", "iVBORw0KGgo="])
    assert both.to_openai_content() == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]


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


# ---------------------------------------------------------------- lifecycle


async def test_session_reuses_one_instance_and_releases_it() -> None:
    counter = Counter(start=1)
    async with counter.session() as run:
        assert (await run.execute({"step": 2})).response.text == "3"
        assert (await run.execute('{"step": 4}')).reward == 7.0
        assert counter.counts == {run.instance_id: 7}
    assert counter.released == [run.instance_id] and counter.counts == {}
    async with counter.session(instance_id="mine") as run:
        assert run.instance_id == "mine"


async def test_release_runs_even_when_execute_raises() -> None:
    tool = Exploding()
    with pytest.raises(RuntimeError, match="boom in"):
        await run_tool(tool, {"step": 1})
    assert len(tool.created) == 1 and tool.released == tool.created

    with pytest.raises(ToolArgumentError):  # bad arguments: created, then released
        await run_tool(tool, {"step": "x"})
    assert tool.released == tool.created and len(tool.created) == 2


async def test_release_runs_when_the_caller_is_cancelled() -> None:
    class Slow(Counter):
        name = "slow"

        async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
            await anyio.sleep(10)
            raise AssertionError("not reached")

    tool = Slow()
    with anyio.fail_after(5), anyio.move_on_after(0.05):
        await run_tool(tool, {"step": 1})
    assert len(tool.created) == 1 and tool.released == tool.created


# ---------------------------------------------------------------- registry


def test_registry_from_functions_and_tools() -> None:
    def helper(text: str) -> str:
        """Echo the text."""
        return text

    counter = Counter()
    registry = ToolRegistry([add, helper])
    assert registry.add(counter) is counter
    assert registry.names == ["add", "helper", "counter"] and len(registry) == 3 and "helper" in registry
    assert registry.get("counter") is counter and [t.name for t in registry] == registry.names
    assert registry.schemas()[1] == {
        "type": "function",
        "function": {
            "name": "helper",
            "description": "Echo the text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    }
    with pytest.raises(ToolNotFoundError, match="unknown tool 'sub'; available: add, helper, counter"):
        registry.get("sub")
    with pytest.raises(ToolDefinitionError, match="two tools are named 'add'"):
        registry.add(function_tool(name="add")(helper))
    with pytest.raises(ToolDefinitionError, match="two tools are named 'counter'"):
        ToolRegistry([Counter(), Counter()])
    with pytest.raises(ToolDefinitionError, match="expects a tool instance or a function, got class"):
        registry.add(Counter)  # type: ignore[arg-type]


async def test_registry_from_yaml() -> None:
    registry = ToolRegistry.from_yaml(YAML)
    assert registry.names == ["counter", "add", "times"]
    counter = registry.get("counter")
    assert isinstance(counter, Counter) and counter.start == 10 and counter.timeout_s == 5
    schema = registry.get("add").openai_schema()["function"]
    assert schema["description"] == "Add two whole numbers."
    assert schema["parameters"]["required"] == ["a", "b"]
    assert add.description == "Add two integers."  # the module's tool is not changed by the override
    assert (await execute_tool_call(registry, "add", '{"a": 2, "b": 5}')).response.text == "7"
    assert (await execute_tool_call(registry, "times", {"x": 2, "y": "1.5"})).response.text == "3.0"
    assert (await execute_tool_call(registry, "counter", {"step": 1})).reward == 11.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: {a: 1}", "expected a list of tools"),
        ("- {klass: x}", r"tools\[0\]: expected a mapping with a 'class' key"),
        ("- {class: tests.tool_fixtures.add, extra: 1}", r"unknown keys \['extra'\]"),
        ("- {class: no_such_module:thing}", "cannot import module 'no_such_module'"),
        ("- {class: tests.tool_fixtures:missing}", "has no attribute 'missing'"),
        (
            "- {class: tests.tool_fixtures:threading}",
            "expected a BaseTool subclass or a @function_tool function",
        ),
        ("- {class: justaname}", "must look like 'package.module:Name'"),
        (
            "- {class: tests.tool_fixtures:Counter, config: {colour: 1}}",
            "cannot build 'tests.tool_fixtures:Counter'",
        ),
        ("- {class: tests.tool_fixtures:Counter, config: [1]}", "config must be a mapping"),
        (
            "- {class: tests.tool_fixtures.add}\n- {class: tests.tool_fixtures.add}",
            "two tools are named 'add'",
        ),
        (
            "- {class: tests.tool_fixtures.add, schema: {parameters: {type: object, properties: {c: {}}}}}",
            r"unknown: \['c'\], required but missing: \['a'\]",
        ),
        ("- {class: tests.tool_fixtures.add, schema: {title: x}}", r"schema has unknown keys \['title'\]"),
        ("- {class: tests.tool_fixtures.add, schema: {name: 'bad name'}}", "tool name must be 1-64"),
        ("- [unclosed", "not valid YAML"),
    ],
)
def test_registry_yaml_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolDefinitionError, match=message):
        ToolRegistry.from_yaml(path)


def test_yaml_schema_override_in_openai_form(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "- class: tests.tool_fixtures:Counter\n"
        "  schema: {type: function, function: {name: tally, description: Count.}}\n"
    )
    assert ToolRegistry.from_yaml(path).schemas()[0]["function"]["name"] == "tally"


# ---------------------------------------------------------------- calls that never raise


async def test_execute_tool_call_turns_failures_into_text() -> None:
    exploding = Exploding()

    @function_tool(timeout_s=0.05)
    async def hang() -> str:
        await anyio.sleep(10)
        return "never"

    release = threading.Event()

    @function_tool
    def hang_sync() -> str:
        release.wait(5)
        return "late"

    registry = ToolRegistry([add, exploding, hang, hang_sync])
    with anyio.fail_after(5):
        unknown = await execute_tool_call(registry, "sub", "{}")
        bad_json = await execute_tool_call(registry, "add", "{a: 1}")
        bad_args = await execute_tool_call(registry, "add", '{"a": "one"}')
        raised = await execute_tool_call(registry, "exploding", {"step": 1})
        slow = await execute_tool_call(registry, "hang", None)
        with structlog.testing.capture_logs() as logs:
            slow_sync = await execute_tool_call(registry, "hang_sync", None, timeout_s=0.05)
    release.set()
    assert [e["tool"] for e in logs if e["event"] == "tool thread abandoned"] == ["hang_sync"]
    assert unknown == ToolResult(
        response=ToolResponse(text="Error: unknown tool 'sub'; available: add, exploding, hang, hang_sync"),
        metrics={"error": "unknown_tool"},
    )
    assert bad_json.metrics == {"error": "invalid_arguments"} and bad_json.reward is None
    assert "are not valid JSON" in (bad_json.response.text or "")
    assert bad_args.response.text == (
        "Error: invalid arguments for tool 'add': argument 'a': expected integer, got 'one'"
    )
    assert raised.response.text is not None and raised.is_error
    assert raised.response.text.startswith("Error: tool 'exploding' raised RuntimeError: boom in")
    assert exploding.released == exploding.created and len(exploding.created) == 1
    assert slow.response.text == "Error: tool 'hang' did not finish within 0.05 s"
    assert slow_sync.metrics == {"error": "timeout"}
    assert not (await execute_tool_call(registry, "add", '{"a": 1}')).is_error


async def test_registry_session_keeps_one_instance_per_tool_for_a_trajectory() -> None:
    counter = Counter()
    registry = ToolRegistry([counter, add])
    async with registry.session() as tools:
        results = []

        async def call(step: int) -> None:
            results.append(await tools.call("counter", {"step": step}))

        async with anyio.create_task_group() as tg:  # parallel calls share the single instance
            for step in (1, 2, 3):
                tg.start_soon(call, step)
        rewards = sorted(r.reward for r in results if r.reward is not None)
        assert len(rewards) == 3 and rewards[-1] == 6.0  # running totals of one counter
        assert (await tools.call("counter", '{"step": 10}')).response.text == "16"
        assert (await tools.call("missing", "{}")).metrics == {"error": "unknown_tool"}
        assert len(counter.created) == 1 and counter.released == []
    assert counter.released == counter.created


def test_base_tool_subclasses_are_checked() -> None:
    class Nameless(Counter):
        name = None  # type: ignore[assignment]

    class FlatParams(Counter):
        name = "flat"
        parameters = {"type": "array"}

    with pytest.raises(ToolDefinitionError, match=r"Nameless: tool name must be 1-64 characters.*got None"):
        Nameless()
    with pytest.raises(
        ToolDefinitionError, match="tool 'flat': parameters must be a JSON schema dict with \"type\""
    ):
        FlatParams()
    with pytest.raises(ToolDefinitionError, match="timeout_s must be a positive number or None, got -1"):
        Counter(timeout_s=-1)
    assert (
        Counter(timeout_s=None).timeout_s is None
        and Counter(name="c2").openai_schema()["function"]["name"] == "c2"
    )


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
        "tools:\n  - class: tests.tool_fixtures.add\n    config: {run_in: process, timeout_s: 30}\n"
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
