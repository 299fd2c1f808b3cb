"""MCP tools for LangGraph agents: an MCP server's tools as LangChain tools, through ``langchain-mcp-adapters``.

::

    class Agent(ReactAgentLoop):            # detached: each call opens its own session, in any event loop
        tools = anyio.run(langchain_mcp_tools, HttpServer(url="http://127.0.0.1:8000/mcp"))

    async with MCPConnection(server) as conn:   # or share one live session (same event loop, inside the with)
        tools = await langchain_mcp_tools(conn)

The adapter makes the ``StructuredTool`` (name, description, ``args_schema`` = the server's
``inputSchema``, unchanged) and turns MCP content into LangChain content blocks and ``isError``
results into ``ToolMessage(status="error")``. Each tool carries one interceptor that runs the call
through ``agentloop.tools.mcp.MCPTool.call`` instead of the adapter's own session: the model's
arguments are checked against the schema first, each call has a deadline (the server is told to
cancel), output is bounded, and a dead server, a timeout or bad arguments reach the model as an error
``ToolMessage`` instead of an exception that would end the graph.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.tools import BaseTool as LangChainTool
from langchain_mcp_adapters.interceptors import MCPToolCallRequest
from langchain_mcp_adapters.sessions import Connection
from langchain_mcp_adapters.tools import convert_mcp_tool_to_langchain_tool
from mcp import types

from agentloop.tools.base import DEFAULT_TIMEOUT_S
from agentloop.tools.mcp import (
    DEFAULT_MAX_OUTPUT_CHARS,
    HttpServer,
    MCPConnection,
    MCPServer,
    MCPTool,
    StdioServer,
    load_mcp_tools,
)

__all__ = ["langchain_mcp_tools"]


def _connection(server: MCPServer) -> Connection:
    """The adapter's connection config for ``server`` (the adapter needs one; our interceptor does the calls)."""
    if isinstance(server, StdioServer):
        return {"transport": "stdio", "command": server.command, "args": list(server.args), "env": server.env}
    headers = {k: v.get_secret_value() for k, v in server.headers.items()}
    return {"transport": "streamable_http", "url": server.url, "headers": headers}


def _bounded(result: types.CallToolResult, max_chars: int | None) -> types.CallToolResult:
    """``result`` with its text cut to ``max_chars`` and content the adapter cannot convert (audio) described."""
    budget = max_chars if max_chars is not None else float("inf")
    content: list[types.ContentBlock] = []
    for block in result.content:
        if isinstance(block, types.AudioContent):
            block = types.TextContent(type="text", text=f"[audio content omitted: {block.mimeType}]")
        if isinstance(block, types.TextContent):
            if len(block.text) > budget:
                cut = max(int(budget), 0)
                text = block.text[:cut] + f"... [truncated {len(block.text) - cut} chars]"
                block = types.TextContent(type="text", text=text)
            budget -= len(block.text)
        elif len(getattr(block, "data", "") or "") > budget:  # an image that does not fit what is left
            block = types.TextContent(
                type="text", text=f"[{block.type} content omitted: over the output limit]"
            )
        else:
            budget -= len(getattr(block, "data", "") or "")
        content.append(block)
    return result.model_copy(update={"content": content})


class _Guard:
    """The interceptor on one tool: check, call through MCPTool.call (never raises), bound the output."""

    def __init__(self, tool: MCPTool) -> None:
        self.tool = tool

    async def __call__(
        self, request: MCPToolCallRequest, handler: Callable[[MCPToolCallRequest], Awaitable[Any]]
    ) -> types.CallToolResult:
        return _bounded(await self.tool.call(request.args), self.tool.max_output_chars)


async def langchain_mcp_tools(
    source: MCPServer | MCPConnection,
    include: Sequence[str] | None = None,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    connect_timeout_s: float = 30.0,
) -> list[LangChainTool]:
    """The tools of an MCP server as LangChain tools for ``ReactAgentLoop.tools`` or any LangGraph graph.

    ``source``: a ``StdioServer`` / ``HttpServer`` (detached tools: each call opens a session, so they
    work in whatever event loop runs the graph: ``Trainer.fit`` runs its own) or an open
    ``MCPConnection`` (calls share its session; use them inside its ``async with``). ``include`` keeps
    only the named tools; ``timeout_s`` bounds each call, ``max_output_chars`` each result.
    """
    if isinstance(source, MCPConnection):
        tools = source.tools(include, timeout_s=timeout_s, max_output_chars=max_output_chars)
        server = source.server
    elif isinstance(source, StdioServer | HttpServer):
        tools = await load_mcp_tools(
            source, include, timeout_s=timeout_s, max_output_chars=max_output_chars,
            connect_timeout_s=connect_timeout_s,
        )  # fmt: skip
        server = source
    else:
        raise TypeError(
            f"source must be a StdioServer, an HttpServer or an open MCPConnection, got {type(source).__name__}"
        )
    return [
        convert_mcp_tool_to_langchain_tool(
            None,
            tool.spec,
            connection=_connection(server),
            tool_interceptors=[_Guard(tool)],
            server_name=server.label,
            handle_tool_errors=True,
        )
        for tool in tools
    ]
