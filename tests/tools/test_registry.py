"""Registries (agentloop.tools.registry): from functions and tools, from YAML, and calls that never raise."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import structlog.testing

from agentloop.errors import ToolDefinitionError, ToolNotFoundError
from agentloop.tools import ToolRegistry, ToolResponse, ToolResult, execute_tool_call, function_tool
from tests.tools.fixtures import Counter, Exploding, add

YAML = Path(__file__).parent / "data" / "tools.yaml"
pytestmark = pytest.mark.anyio  # parametrized async tests need the marker at collection time


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
        ("- {class: tests.tools.fixtures.add, extra: 1}", r"unknown keys \['extra'\]"),
        ("- {class: no_such_module:thing}", "no module named 'no_such_module' on the Python path"),
        ("- {class: tests.tools.fixtures:missing}", "has no attribute 'missing'"),
        (
            "- {class: tests.tools.fixtures:threading}",
            "expected a BaseTool subclass or a @function_tool function",
        ),
        (
            "- {class: justaname}",
            r"tools\[0\]: class must look like module:object \(package.module:name, package.module.name or "
            r"path/to/file.py:name\), got 'justaname'",
        ),
        (
            "- {class: tests.tools.fixtures:Counter, config: {colour: 1}}",
            "cannot build 'tests.tools.fixtures:Counter'",
        ),
        ("- {class: tests.tools.fixtures:Counter, config: [1]}", "config must be a mapping"),
        (
            "- {class: tests.tools.fixtures.add}\n- {class: tests.tools.fixtures.add}",
            "two tools are named 'add'",
        ),
        (
            "- {class: tests.tools.fixtures.add, schema: {parameters: {type: object, properties: {c: {}}}}}",
            r"unknown: \['c'\], required but missing: \['a'\]",
        ),
        ("- {class: tests.tools.fixtures.add, schema: {title: x}}", r"schema has unknown keys \['title'\]"),
        ("- {class: tests.tools.fixtures.add, schema: {name: 'bad name'}}", "tool name must be 1-64"),
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
        "- class: tests.tools.fixtures:Counter\n"
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
