"""MCP tools (agentloop.tools.mcp, integrations.mcp) against a real FastMCP server (tests/tools/mcp_server.py)
started by each test over stdio (a subprocess the client starts) or streamable HTTP (a subprocess on a
loopback port): exact schemas, calls, errors, timeouts, a server that dies, and the tools inside ToolAgent
and ReactAgentLoop through the real proxy, store and runner."""

from __future__ import annotations

import json
import pickle
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from agentloop.errors import ToolDefinitionError, ToolError
from agentloop.proxy.server import Proxy
from agentloop.resources import Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.tools import ToolRegistry, execute_tool_call
from agentloop.tools.agent import ToolAgent
from agentloop.tools.mcp import (
    HttpServer,
    MCPConnection,
    MCPServer,
    MCPTool,
    StdioServer,
    load_mcp_tools,
    mcp_tools,
)
from agentloop.types import LLMCall, RolloutStatus, ToolCall
from tests.integrations.scripted import scripted_engine, tool_call_text

pytestmark = pytest.mark.e2e  # MCP servers run in subprocesses

SERVER = Path(__file__).with_name("mcp_server.py")
TOOL_NAMES = ["add", "echo", "search", "image", "boom", "sleep", "stats", "counter", "big", "header", "crash"]


def stdio() -> StdioServer:
    return StdioServer(command=sys.executable, args=[str(SERVER), "stdio"], name="test-stdio")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_http_server(mode: str = "http") -> tuple[HttpServer, subprocess.Popen[bytes]]:
    """The test server over streamable HTTP on a free loopback port, once it accepts connections."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), mode, str(port)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, "the HTTP MCP server exited at start"
        assert time.monotonic() < deadline, "the HTTP MCP server did not listen within 30 s"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return HttpServer(url=f"http://127.0.0.1:{port}/mcp", name="test-http"), proc
        except OSError:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def http_server() -> Iterator[HttpServer]:
    """One HTTP server for the module (each test opens its own session; a server start costs ~2 s)."""
    srv, proc = start_http_server()
    yield srv
    proc.kill()
    proc.wait()


@pytest.fixture(params=["stdio", "http"])
def server(request: pytest.FixtureRequest) -> MCPServer:
    return stdio() if request.param == "stdio" else request.getfixturevalue("http_server")


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def by_name(tools: list[MCPTool]) -> dict[str, MCPTool]:
    return {t.name: t for t in tools}


# ---------------------------------------------------------------- schemas and calls


async def test_tools_carry_the_servers_schemas_exactly(server: MCPServer) -> None:
    async with MCPConnection(server) as conn:  # what the server lists, read through the raw SDK session
        raw = {t.name: t for t in conn.listed}
    if isinstance(server, StdioServer):  # and once more without agentloop in the way
        params = StdioServerParameters(command=server.command, args=server.args)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            direct = {t.name: t.inputSchema for t in (await session.list_tools()).tools}
        assert direct == {name: t.inputSchema for name, t in raw.items()}
    async with mcp_tools(server) as tools:
        assert [t.name for t in tools] == TOOL_NAMES
        for tool in tools:
            spec = raw[tool.name]
            assert tool.openai_schema() == {
                "type": "function",
                "function": {
                    "name": spec.name,
                    "description": spec.description,
                    "parameters": spec.inputSchema,
                },
            }
        assert ToolRegistry(tools).schemas() == [t.openai_schema() for t in tools]
    search = by_name(tools)["search"].parameters
    assert search["required"] == ["query", "filters"]
    assert search["properties"]["order"]["enum"] == ["new", "old"] and "$defs" in search  # nested model kept
    assert by_name(tools)["echo"].parameters["properties"]["times"]["maximum"] == 5


async def test_calls_return_text_structured_and_image_content(server: MCPServer) -> None:
    async with mcp_tools(server) as tools:
        registry = ToolRegistry(tools)
        add = await execute_tool_call(registry, "add", '{"a": 2, "b": 3}')
        echo = await execute_tool_call(registry, "echo", {"text": "hi", "times": 2})
        found = await execute_tool_call(registry, "search", {"query": "q", "filters": {"tags": ["a"]}})
        image = await execute_tool_call(registry, "image", "")
        async with registry.session() as run:  # one trajectory: the session (and server state) is shared
            counts = [(await run.call("counter", "{}")).response.text for _ in range(2)]
    assert (add.response.text, add.is_error) == ("5", False)
    assert echo.response.text == "hi hi"
    assert json.loads(found.response.text or "") == {
        "query": "q",
        "tags": ["a"],
        "year": None,
        "order": "new",
    }
    assert image.response.images and image.response.images[0].startswith("data:image/png;base64,iVBOR")
    assert counts == ["1", "2"]


async def test_bad_arguments_are_refused_with_clear_errors() -> None:
    async with mcp_tools(stdio()) as tools:
        registry = ToolRegistry(tools)
        cases: list[tuple[str, Any, str]] = [
            ("add", '{"a": "x", "b": 1}', "argument 'a': expected integer, got \"x\""),
            ("add", '{"a": 1}', "missing required argument 'b'"),
            ("add", '{"a": 1,', "are not valid JSON"),
            ("search", {"query": "q", "filters": {"tags": "a"}}, "argument 'filters.tags': expected array, got \"a\""),
            ("search", {"query": "q", "filters": {}}, "argument 'filters': missing required field 'tags'"),
            ("search", {"query": "q", "filters": {"tags": []}, "order": "mid"}, 'argument \'order\': expected "new" or "old", got "mid"'),
            ("echo", {"text": "x", "times": 9}, "argument 'times': 9 is greater than the maximum of 5"),
        ]  # fmt: skip
        for name, args, expected in cases:
            result = await execute_tool_call(registry, name, args)
            assert result.metrics["error"] == "invalid_arguments", (name, args, result)
            assert expected in (result.response.text or ""), result.response.text
            assert (result.response.text or "").startswith(
                f"Error: invalid arguments for tool {name!r}: "
            ) or ("not valid JSON" in expected)
        direct = await by_name(tools)["add"].execute(
            "i", {"a": True, "b": 1}
        )  # never raises, even called directly
        assert direct.metrics["error"] == "invalid_arguments" and "expected integer, got true" in (
            direct.response.text or ""
        )
        stats = await execute_tool_call(registry, "stats", {})
    assert json.loads(stats.response.text or "")["calls"] == 0  # nothing invalid reached the server


async def test_arguments_are_checked_before_any_server_is_started() -> None:
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}}, "mode": {"enum": [1, 2]}},
        "required": ["items"],
        "additionalProperties": False,
    }
    tool = MCPTool(types.Tool(name="f", inputSchema=schema), StdioServer(command="/nonexistent/server"))
    result = await tool.call({"items": [1, "2", 3, "4"], "mode": {3}, "x": 1, "y": 2, "z": 3, "w": 4})
    text = result.content[0].text  # type: ignore[union-attr]
    assert result.isError and (result.meta or {})["agentloop/error"] == "invalid_arguments"
    assert text.startswith("Error: invalid arguments for tool 'f': unexpected argument 'x', 'y', 'z', 'w'")
    assert "argument 'mode': expected 1 or 2, got \"{3}\"" in text  # not JSON (a set): shown, not raised
    assert "argument 'items[1]': expected integer, got \"2\"" in text and "and 1 more" not in text
    with pytest.raises(ToolDefinitionError, match="invalid inputSchema"):
        MCPTool(types.Tool(name="g", inputSchema={"type": "object", "properties": 3}), stdio())


async def test_tool_errors_become_error_results(server: MCPServer) -> None:
    async with mcp_tools(server) as tools:
        boom = await execute_tool_call(ToolRegistry(tools), "boom", {"x": 3})
        after = await execute_tool_call(ToolRegistry(tools), "add", {"a": 1, "b": 1})
    assert boom.metrics["error"] == "tool_error" and boom.reward is None
    assert (boom.response.text or "").startswith("Error") and "kaboom 3" in (boom.response.text or "")
    assert after.response.text == "2"  # the session goes on


async def test_a_hanging_tool_times_out_and_the_server_cancels_it(server: MCPServer) -> None:
    async with mcp_tools(server, timeout_s=0.5) as tools:
        tool = by_name(tools)["sleep"]
        start = time.monotonic()
        result = await tool.execute("i", {"seconds": 60})
        took = time.monotonic() - start
        via_registry = await execute_tool_call(ToolRegistry(tools), "sleep", {"seconds": 60}, timeout_s=0.3)
        with anyio.fail_after(10):
            while True:  # the cancel notification reaches the server, which stops both sleeps
                stats = json.loads((await tool_text(tools, "stats")) or "{}")
                if stats["sleep_cancelled"] == 2:
                    break
                await anyio.sleep(0.05)
        quick = await tool.execute("i", {"seconds": 0.01})
    assert result.metrics["error"] == "timeout" and "did not finish within 0.5 s" in (
        result.response.text or ""
    )
    assert 0.5 <= took < 5, took
    assert via_registry.metrics["error"] == "timeout"
    assert stats["sleep_started"] == 2 and quick.response.text == "slept 0.01"


async def tool_text(tools: list[MCPTool], name: str, args: dict[str, Any] | None = None) -> str | None:
    return (await by_name(tools)[name].execute("i", args or {})).response.text


async def test_output_is_capped() -> None:
    async with mcp_tools(stdio(), max_output_chars=1000) as tools:
        big = await by_name(tools)["big"].execute("i", {"n": 5000})
        small = await by_name(tools)["big"].execute("i", {"n": 10})
        image = await by_name(tools)["image"].execute("i", {})
    assert big.response.text == "x" * 1000 + "... [truncated 4000 chars]" and big.metrics == {
        "truncated_chars": 4000
    }
    assert small.response.text == "x" * 10 and small.metrics == {}
    assert image.response.images  # a 1x1 PNG fits
    async with mcp_tools(stdio(), ["image"], max_output_chars=20) as tools:
        image = await tools[0].execute("i", {})
    assert not image.response.images and "image omitted" in (image.response.text or "")


# ---------------------------------------------------------------- a server that dies


async def test_a_stdio_server_that_dies_gives_clear_errors() -> None:
    async with mcp_tools(stdio()) as tools:
        with anyio.fail_after(20):
            crash = await execute_tool_call(ToolRegistry(tools), "crash", {})
            start = time.monotonic()
            after = await execute_tool_call(ToolRegistry(tools), "add", {"a": 1, "b": 2})
    for result in (crash, after):
        assert result.metrics["error"] == "connection_lost", result
        assert "'test-stdio' is not" in (result.response.text or "") and "closed the connection" in (
            result.response.text or ""
        ), result.response.text
    assert time.monotonic() - start < 1  # a lost session fails at once, not at the call's deadline


async def test_an_http_server_killed_mid_session_gives_clear_errors() -> None:
    srv, proc = await anyio.to_thread.run_sync(start_http_server)  # this test kills its own server
    try:
        async with mcp_tools(srv, timeout_s=30) as tools:
            assert (await tool_text(tools, "add", {"a": 1, "b": 2})) == "3"
            proc.kill()
            proc.wait()
            start = time.monotonic()
            with anyio.fail_after(20):
                lost = await by_name(tools)["add"].execute("i", {"a": 1, "b": 2})
                again = await by_name(tools)["add"].execute("i", {"a": 1, "b": 2})
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - start < 10  # the transport's failure ends the call, not its 30 s deadline
    for result in (lost, again):
        assert result.metrics["error"] == "connection_lost", result
        assert "MCP server 'test-http' is not" in (result.response.text or ""), result.response.text


async def test_closing_does_not_wait_for_a_server_that_never_answers_its_delete() -> None:
    """Issue 44 finding 10: the SDK ends an HTTP session with a DELETE under the client's 300 s read
    timeout, and leaving ``mcp_tools`` waited all of it for a server that never answers."""
    srv, proc = await anyio.to_thread.run_sync(start_http_server, "http-ignoring-delete")
    try:
        with anyio.fail_after(60):  # today: 300 s
            async with mcp_tools(srv) as tools:
                assert (await tool_text(tools, "add", {"a": 1, "b": 2})) == "3"
                start = time.monotonic()
            closed_in = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert closed_in < 5 + 2, closed_in  # close_timeout_s (5 s) and a margin


async def test_a_tool_the_server_no_longer_has_gives_an_error_result() -> None:
    spec = types.Tool(name="ghost", inputSchema={"type": "object"})  # listed once, gone now
    result = await MCPTool(spec, stdio()).execute("i", {})
    assert result.metrics["error"] == "tool_error" and result.response.text == "Error: Unknown tool: ghost"


async def test_tools_of_a_closed_connection_say_so() -> None:
    async with mcp_tools(stdio()) as tools:
        pass
    result = await by_name(tools)["add"].execute("i", {"a": 1, "b": 2})
    assert result.metrics["error"] == "connection_lost" and "its `async with` ended" in (
        result.response.text or ""
    )


async def test_connecting_to_a_server_that_is_not_there_raises() -> None:
    broken = StdioServer(command=sys.executable, args=["-c", "import sys; sys.exit(2)"], name="broken")
    with pytest.raises(ToolError, match="cannot connect to MCP server 'broken'"):
        async with mcp_tools(broken):
            pass
    with pytest.raises(ToolError, match=re.escape("cannot connect to MCP server 'http://127.0.0.1:")):
        await load_mcp_tools(HttpServer(url=f"http://127.0.0.1:{_free_port()}/mcp"))
    with pytest.raises(ToolError, match="did not answer initialize"):
        async with mcp_tools(StdioServer(command=sys.executable, args=["-c", "import time; time.sleep(30)"]),
                             connect_timeout_s=0.5):  # fmt: skip
            pass


# ---------------------------------------------------------------- choosing tools, detached tools


async def test_include_and_rename() -> None:
    async with mcp_tools(stdio(), ["echo", "add"], rename={"add": "plus"}) as tools:
        assert [t.name for t in tools] == ["echo", "plus"] and tools[1].mcp_name == "add"
        assert (await execute_tool_call(ToolRegistry(tools), "plus", {"a": 2, "b": 2})).response.text == "4"
        assert tools[1].openai_schema()["function"]["name"] == "plus"
    with pytest.raises(ToolDefinitionError, match="has no tool 'nope'; it has: add, echo"):
        async with mcp_tools(stdio(), ["nope"]):
            pass
    with pytest.raises(ToolDefinitionError, match="not a valid function name"):
        async with mcp_tools(stdio(), rename={"add": "a.b"}):
            pass


async def test_detached_tools_open_a_session_per_call_and_pickle() -> None:
    tools = await load_mcp_tools(stdio(), ["counter", "add"])
    assert all(t.connection is None for t in tools)
    counts = [await tool_text(tools, "counter") for _ in range(2)]
    assert counts == ["1", "1"]  # a fresh server process each call
    async with mcp_tools(stdio(), ["add"]) as live:
        copy = pickle.loads(pickle.dumps(live[0]))  # a live session does not travel: the copy is detached
    assert copy.connection is None and copy.openai_schema() == live[0].openai_schema()
    assert (await copy.execute("i", {"a": 5, "b": 6})).response.text == "11"
    bad = await copy.execute("i", {"a": "5"})
    assert bad.metrics["error"] == "invalid_arguments"


# ---------------------------------------------------------------- inside agents


async def run_agent(agent: Any, engine: Any, tasks: list[Any]) -> tuple[MemoryStore, list[str]]:
    store = MemoryStore()
    async with Proxy(engine, store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("m", {"max_tokens": 256})}))
        ids = [(await store.enqueue_rollout(t)).rollout_id for t in tasks]
        with anyio.fail_after(60):
            await Runner(agent, store, concurrency=2, poll_interval=0.01).run(max_rollouts=len(tasks))
    return store, ids


async def test_tool_agent_uses_mcp_tools_through_the_proxy(tok: Any) -> None:
    script = [
        tool_call_text("add", {"a": 2, "b": 3})
        + tool_call_text("boom", {"x": 1})
        + tool_call_text("add", {"a": "2"}),
        "The answer is 5",
    ]
    reward = lambda task, answer: float(answer is not None and answer.endswith(task["answer"]))  # noqa: E731
    async with mcp_tools(stdio(), ["add", "boom"]) as tools:
        agent = ToolAgent(tools, reward)
        store, ids = await run_agent(
            agent, scripted_engine(tok, script), [{"question": "2+3?", "answer": "5"}] * 2
        )
    for rid in ids:
        assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
        spans = await store.query_spans(rid)
        calls = [s.payload for s in spans if isinstance(s.payload, ToolCall)]
        assert [(c.name, c.error) for c in calls] == [
            ("add", None),
            ("boom", "tool_error"),
            ("add", "invalid_arguments"),
        ]
        assert (
            calls[0].result == "5"
            and "kaboom 1" in calls[1].result
            and "missing required argument 'b'" in calls[2].result
        )
        llm_calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
        assert llm_calls[0].tools == [
            t.openai_schema() for t in tools
        ]  # what the model saw: the server's schemas
        assert [m["content"] for m in llm_calls[1].messages if m["role"] == "tool"] == [
            c.result for c in calls
        ]
        assert spans[-1].payload.value == 1.0  # type: ignore[union-attr]


async def test_react_agent_loop_uses_mcp_tools_through_langchain_mcp_adapters(tok: Any) -> None:
    from langchain_core.messages import ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from integrations.langgraph import ReactAgentLoop
    from integrations.mcp import langchain_mcp_tools

    tools = await langchain_mcp_tools(stdio(), ["add", "boom"], timeout_s=20)  # detached: any event loop
    states: list[Any] = []

    class Adder(ReactAgentLoop):
        max_steps = 6

        def reward(self, task: Any, final_state: Any) -> float:
            states.append(final_state)
            return float(task["answer"] in final_state["messages"][-1].content)

    Adder.tools = tools
    script = [
        tool_call_text("add", {"a": 2, "b": 3})
        + tool_call_text("boom", {"x": 1})
        + tool_call_text("add", {"a": "x"}),
        "It is 5",
    ]
    store, ids = await run_agent(Adder(), scripted_engine(tok, script), [{"question": "2+3?", "answer": "5"}])
    assert (await store.get_rollout(ids[0])).status is RolloutStatus.SUCCEEDED
    results = [m for m in states[0]["messages"] if isinstance(m, ToolMessage)]
    assert [m.status for m in results] == ["success", "error", "error"]
    texts = [m.text for m in results]
    assert texts[0] == "5" and "kaboom 1" in texts[1] and "argument 'a': expected integer" in texts[2]
    async with MCPConnection(stdio()) as conn:
        listed = {t.name: t for t in conn.listed}
    assert [t.args_schema for t in tools] == [listed["add"].inputSchema, listed["boom"].inputSchema]  # exact
    # What the model saw is LangChain's rendering of that schema (titles dropped, $refs inlined), the
    # same any LangChain chat model sends in production: the rollout trains on what the app will send.
    llm_calls = [s.payload for s in await store.query_spans(ids[0]) if isinstance(s.payload, LLMCall)]
    assert llm_calls[0].tools == [convert_to_openai_tool(t) for t in tools]
    assert llm_calls[0].tools[0]["function"] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": untitled(listed["add"].inputSchema),
    }
    assert (await store.query_spans(ids[0]))[-1].payload.value == 1.0  # type: ignore[union-attr]


async def test_langchain_tools_can_share_one_live_session() -> None:
    from integrations.mcp import langchain_mcp_tools

    async with MCPConnection(stdio()) as conn:
        counter, add = await langchain_mcp_tools(conn, ["counter", "add"])
        counts = [(await counter.ainvoke(call("counter", {}))).text for _ in range(2)]
        bad = await add.ainvoke(call("add", {"a": 1}))
    assert counts == ["1", "2"]  # one server process, its state kept between calls
    assert bad.status == "error" and "missing required argument 'b'" in bad.text


def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A LangChain tool call (invoking a tool with one returns a ToolMessage)."""
    return {"type": "tool_call", "name": name, "args": args, "id": "call-1"}


async def test_http_headers_reach_the_server(http_server: HttpServer) -> None:
    server = HttpServer.model_validate({**http_server.model_dump(), "headers": {"X-Api-Key": "k-123"}})
    async with mcp_tools(server, ["header"]) as tools:
        assert (await tools[0].execute("i", {"name": "x-api-key"})).response.text == "k-123"
    async with mcp_tools(stdio(), ["header"]) as tools:
        assert (await tools[0].execute("i", {"name": "x-api-key"})).response.text == ""


def untitled(schema: Any) -> Any:
    """A JSON schema without its "title" keys (what LangChain leaves out)."""
    if isinstance(schema, dict):
        return {k: untitled(v) for k, v in schema.items() if k != "title"}
    return [untitled(v) for v in schema] if isinstance(schema, list) else schema


def test_a_server_config_keeps_its_secrets() -> None:
    server = HttpServer.model_validate(
        {"url": "http://127.0.0.1:1/mcp", "headers": {"Authorization": "Bearer s3cret"}}
    )
    assert "s3cret" not in repr(server) and "s3cret" not in str(server.model_dump())
    with pytest.raises(ValueError, match="url must start with http"):
        HttpServer(url="ftp://x")
