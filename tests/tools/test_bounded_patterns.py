"""An MCP server's schema is hostile input too (issue 44 finding 11): its regular expressions are matched
within a time budget, off the event loop, inside the call's deadline. The tools here point at a server
that does not exist: the arguments are checked before anything connects."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from mcp import types

from agentloop.errors import ToolDefinitionError
from agentloop.tools import ToolRegistry, execute_tool_call
from agentloop.tools.mcp import MCPTool, StdioServer
from tests.loop_watch import watch_event_loop

NOWHERE = StdioServer(command="/nonexistent/server", name="nowhere")
EVIL = r"^(a|a)*$"  # backtracks 2**n steps on n a's and a mismatch, in re and in regex alike
HOSTILE = "a" * 26 + "!"  # re: minutes (4.1 s at 25 characters on the review's machine, doubling each)
# The longest event-loop gap allowed (ticks every 10 ms). Unbounded, one match stalled the loop for
# minutes; matched on the loop within the budget, for the whole budget (1 s of CPU, seconds of wall
# here). Off the loop the gaps are ~10 ms, but a 2-core CPU shared with a training run has shown 0.5 s
# of scheduling delay.
STALL_S = 1.0


def tool(schema: dict[str, Any], timeout_s: float = 5.0) -> MCPTool:
    spec = types.Tool(name="lookup", inputSchema={"type": "object", **schema})
    return MCPTool(spec, NOWHERE, timeout_s=timeout_s)


SCHEMAS = {
    "pattern": ({"properties": {"q": {"type": "string", "pattern": EVIL}}}, {"q": HOSTILE}),
    "patternProperties": ({"patternProperties": {EVIL: {"type": "integer"}}}, {HOSTILE: 1}),
    "additionalProperties": (
        {"properties": {}, "patternProperties": {EVIL: {}}, "additionalProperties": False},
        {HOSTILE: 1},
    ),
    "propertyNames": ({"propertyNames": {"pattern": EVIL}}, {HOSTILE: 1}),
}


@pytest.mark.parametrize("where", list(SCHEMAS))
async def test_a_backtracking_pattern_neither_stalls_the_loop_nor_outlives_the_deadline(where: str) -> None:
    schema, args = SCHEMAS[where]
    registry = ToolRegistry([tool(schema)])
    async with watch_event_loop(interval_s=0.01) as gaps:
        await anyio.sleep(0.05)  # the ticker runs first: the check starts before the call's first await
        start = time.monotonic()
        result = await execute_tool_call(registry, "lookup", args, timeout_s=5.0)
        took = time.monotonic() - start
    assert max(gaps) < STALL_S, f"the event loop stalled {max(gaps):.2f} s"
    assert took < 5.0 + 1, took
    assert result.metrics["error"] in ("invalid_arguments", "timeout"), result
    if result.metrics["error"] == "invalid_arguments":
        assert "ran past its time budget" in (result.response.text or ""), result.response.text


async def test_the_check_shares_the_calls_deadline() -> None:
    registry = ToolRegistry([tool(SCHEMAS["pattern"][0], timeout_s=0.3)])
    async with watch_event_loop(interval_s=0.01) as gaps:
        await anyio.sleep(0.05)  # the ticker runs first: the check starts before the call's first await
        start = time.monotonic()
        result = await execute_tool_call(registry, "lookup", {"q": HOSTILE})
        took = time.monotonic() - start
    assert result.metrics["error"] == "timeout" and took < 0.3 + 1, (result, took)
    assert max(gaps) < STALL_S


async def test_ordinary_patterns_still_check() -> None:
    schema = {
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}},
        "patternProperties": {"^x-": {"type": "integer"}},
        "additionalProperties": False,
    }
    registry = ToolRegistry([tool(schema)])
    bad = await execute_tool_call(registry, "lookup", {"code": "abc-1"})
    assert bad.metrics["error"] == "invalid_arguments"
    assert "argument 'code': 'abc-1' does not match" in (bad.response.text or ""), bad.response.text
    extra = await execute_tool_call(registry, "lookup", {"code": "ABC-1", "y": 1})
    assert "unexpected argument 'y'" in (extra.response.text or ""), extra.response.text
    typed = await execute_tool_call(registry, "lookup", {"code": "ABC-1", "x-n": "one"})
    assert "argument 'x-n': expected integer" in (typed.response.text or ""), typed.response.text
    fine = await execute_tool_call(registry, "lookup", {"code": "ABC-12", "x-n": 3})
    assert fine.metrics["error"] == "connection_lost"  # valid: it went on to the (absent) server


def test_a_schema_whose_key_matching_cannot_be_bounded_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="unevaluatedProperties together with patternProperties"):
        tool({"patternProperties": {"^a": {}}, "unevaluatedProperties": False})
