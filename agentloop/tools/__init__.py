"""Tools an agent can call, one concept per module; every public name is re-exported here.

- ``base``: BaseTool, ToolResponse, ToolResult and a tool's lifecycle (create, execute, release)
- ``schema``: JSON schemas and argument validation inferred from a function's signature
- ``function``: ``@function_tool`` (FunctionTool), where a sync tool runs (thread or killed process)
- ``registry``: ToolRegistry (from functions or a YAML file) and ``execute_tool_call``, which never raises
- ``agent``: ToolAgent, the built-in ReAct loop over the OpenAI API (imported on first use: it
  pulls in ``openai``)
- ``mcp``: the tools of MCP servers (stdio, streamable HTTP) as BaseTools: ``mcp_tools``,
  ``load_mcp_tools`` (imported on first use: it pulls in the ``mcp`` SDK, the ``mcp`` extra)

Imports go one way, ``schema`` <- ``base`` <- ``function`` <- ``registry`` <- ``agent``, so no module
imports the package that re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentloop.tools.base import DEFAULT_TIMEOUT_S, BaseTool, ToolResponse, ToolResult, ToolSession, run_tool
from agentloop.tools.function import FunctionTool, RunIn, function_tool, to_tool_result
from agentloop.tools.registry import RegistrySession, ToolRegistry, execute_tool_call

if TYPE_CHECKING:  # imported lazily by __getattr__ below
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

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BaseTool",
    "FunctionTool",
    "HttpServer",
    "MCPConnection",
    "MCPServer",
    "MCPTool",
    "RegistrySession",
    "RunIn",
    "StdioServer",
    "ToolAgent",
    "ToolRegistry",
    "ToolResponse",
    "ToolResult",
    "ToolSession",
    "execute_tool_call",
    "function_tool",
    "load_mcp_tools",
    "mcp_tools",
    "run_tool",
    "to_tool_result",
]


_MCP = {"HttpServer", "MCPConnection", "MCPServer", "MCPTool", "StdioServer", "load_mcp_tools", "mcp_tools"}


def __getattr__(name: str) -> Any:
    if name == "ToolAgent":  # agentloop.tools.agent imports openai: only when asked for
        from agentloop.tools.agent import ToolAgent

        return ToolAgent
    if name in _MCP:  # agentloop.tools.mcp imports the mcp SDK (an extra): only when asked for
        from agentloop.tools import mcp

        return getattr(mcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
