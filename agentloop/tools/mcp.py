"""Tools from MCP servers (stdio or streamable HTTP) as ``BaseTool``s, through the official ``mcp`` SDK.

Two ways to hold a server, one tool class (``MCPTool``)::

    async with mcp_tools(StdioServer(command="python", args=["server.py"])) as tools:
        agent = ToolAgent(tools, reward_fn)            # one live session, shared by every call
        await Runner(agent, store).run(max_rollouts=8)

    tools = await load_mcp_tools(HttpServer(url="http://127.0.0.1:8000/mcp"))
    Trainer(config).fit(ToolAgent(tools, reward_fn), tasks)   # each call opens its own session

``mcp_tools`` keeps one ``ClientSession`` open for the ``async with`` (cheap calls, state kept between
them; use it where the agent runs in that same event loop). ``load_mcp_tools`` lists the tools and
disconnects: its tools connect per call, so they work in any event loop or process (``Trainer.fit``
runs its own loop; remote runners unpickle the agent). Per call means a new server process for stdio
(~2 s for a Python FastMCP server on a 2-core CPU, most of it importing the SDK): prefer streamable
HTTP there, or hold a session around your own ``Runner.run``.

Each tool's schema is the server's ``inputSchema``, unchanged; the model's arguments are checked
against it before anything is sent; a call never raises on a fault but returns an error ``ToolResult``
(``"Error: ..."``, ``metrics["error"]`` names the kind). One concept per module, every public name
re-exported here:

- ``mcp_connection``: ``StdioServer``, ``HttpServer``, ``MCPSession`` (the session, its transport)
- ``mcp_convert``: arguments against the ``inputSchema``, MCP results as ``ToolResult``
- ``mcp_tool``: ``MCPTool`` (a ``BaseTool``: bound to a connection, or detached)
- this module: ``mcp_tools`` and ``load_mcp_tools``, the two ways to hold a server, and
  ``MCPConnection`` (an ``MCPSession`` whose ``tools()`` are bound to it: it makes ``MCPTool``s, which
  open an ``MCPSession`` when detached, so it sits above both modules)
- ``integrations.mcp``: the same tools for LangGraph agents (``langchain-mcp-adapters``)

Traps: the session lives in a task of the ``async with``, hence the tools of ``mcp_tools`` are usable
only inside it. ``max_output_chars`` bounds what reaches the model and the spans, not what the
SDK reads: a server is trusted not to send gigabytes. A stdio server inherits only a minimal
environment (the SDK's ``HOME``, ``PATH``, ...) plus ``StdioServer.env``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from agentloop.tools.base import DEFAULT_TIMEOUT_S
from agentloop.tools.mcp_connection import (
    DEFAULT_MAX_OUTPUT_CHARS,
    HttpServer,
    MCPServer,
    MCPSession,
    StdioServer,
)
from agentloop.tools.mcp_convert import ERROR_META, check_arguments, result_from_mcp
from agentloop.tools.mcp_tool import MCPTool, make_tools

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "ERROR_META",
    "HttpServer",
    "MCPConnection",
    "MCPServer",
    "MCPTool",
    "StdioServer",
    "check_arguments",
    "load_mcp_tools",
    "mcp_tools",
    "result_from_mcp",
]


class MCPConnection(MCPSession):
    """A live session with one MCP server that also makes its tools: ``async with MCPConnection(server)
    as conn: conn.tools()`` (the session itself: ``MCPSession``, agentloop.tools.mcp_connection)."""

    def tools(
        self,
        include: Sequence[str] | None = None,
        *,
        rename: Mapping[str, str] | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> list[MCPTool]:
        """The server's tools bound to this session (``include``: only these, by MCP name)."""
        return make_tools(self.listed, self.server, self, include, rename, timeout_s, max_output_chars)


@asynccontextmanager
async def mcp_tools(
    server: MCPServer,
    include: Sequence[str] | None = None,
    *,
    rename: Mapping[str, str] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    connect_timeout_s: float = 30.0,
) -> AsyncIterator[list[MCPTool]]:
    """``async with mcp_tools(server) as tools``: the server's tools on one session held open meanwhile.

    ``include`` keeps only the named tools (MCP names, in that order); ``rename`` maps an MCP name to
    the name the model sees (for names the OpenAI API refuses, or clashes between servers);
    ``timeout_s`` bounds each call; ``max_output_chars`` bounds each result.
    """
    async with MCPConnection(server, connect_timeout_s=connect_timeout_s) as conn:
        yield conn.tools(include, rename=rename, timeout_s=timeout_s, max_output_chars=max_output_chars)


async def load_mcp_tools(
    server: MCPServer,
    include: Sequence[str] | None = None,
    *,
    rename: Mapping[str, str] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    connect_timeout_s: float = 30.0,
) -> list[MCPTool]:
    """The server's tools, detached: listed now, each call then opens (and closes) a session of its own,
    in whatever event loop or process runs it. Arguments as for ``mcp_tools``."""
    async with MCPConnection(server, connect_timeout_s=connect_timeout_s) as conn:
        listed = conn.listed
    return make_tools(listed, server, None, include, rename, timeout_s, max_output_chars)
