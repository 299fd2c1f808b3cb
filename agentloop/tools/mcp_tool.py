"""``MCPTool``: one tool of an MCP server as a ``BaseTool``, and the list of a server's tools.

Each tool's schema is the server's ``inputSchema``, unchanged (``openai_schema()`` carries name,
description and parameters as listed). A call never raises on a fault but returns an error
``ToolResult`` (``"Error: ..."``, ``metrics["error"]``): ``invalid_arguments``, ``tool_error`` (the
server's ``isError``), ``server_error`` (a JSON-RPC error), ``invalid_output``, ``timeout`` (the server
is told to cancel the request) and ``connection_lost`` (the server died or the session was closed;
later calls fail at once with the same reason).
"""

from __future__ import annotations

import copy
import functools
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from mcp import types

from agentloop.errors import ToolArgumentError, ToolDefinitionError, ToolError
from agentloop.tools.base import DEFAULT_TIMEOUT_S, BaseTool, ToolResult
from agentloop.tools.mcp_connection import (
    DEFAULT_MAX_OUTPUT_CHARS,
    CallFailed,
    MCPServer,
    MCPSession,
)
from agentloop.tools.mcp_convert import check_arguments, error_result, result_from_mcp, schema_validator
from agentloop.tools.schema import decode_arguments

__all__ = ["MCPTool", "make_tools"]


class MCPTool(BaseTool):
    """One tool of an MCP server. Bound to an ``MCPConnection`` (``mcp_tools``; any ``MCPSession``),
    calls share its session; detached (``load_mcp_tools``, or unpickled), each call opens a session of its own."""

    def __init__(
        self,
        spec: types.Tool,
        server: MCPServer,
        connection: MCPSession | None = None,
        *,
        name: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        if max_output_chars is not None and (
            isinstance(max_output_chars, bool)
            or not isinstance(max_output_chars, int)
            or max_output_chars < 1
        ):
            raise ToolDefinitionError(
                f"max_output_chars must be an int >= 1 or None, got {max_output_chars!r}"
            )
        self.spec = spec  # as the server listed it: title, annotations, outputSchema, _meta
        self.mcp_name = spec.name
        self.server = server
        self.connection = connection
        self.max_output_chars = max_output_chars
        super().__init__(
            name=name or spec.name,
            description=spec.description or "",
            parameters=copy.deepcopy(spec.inputSchema),
            timeout_s=timeout_s,
        )
        self._validator = schema_validator(self.parameters, spec.name, server.label)

    def __getstate__(
        self,
    ) -> dict[str, Any]:  # a live session does not travel: unpickled, the tool is detached
        state = self.__dict__.copy()
        state["connection"] = None
        del state["_validator"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._validator = schema_validator(self.parameters, self.mcp_name, self.server.label)

    def parse_arguments(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Decode the model's arguments. The check against the server's inputSchema comes in
        :meth:`call`: the schema is the server's (its patterns may backtrack), so it runs off the
        event loop and inside the call's deadline."""
        return decode_arguments(raw, self.name)

    async def check_arguments(self, args: dict[str, Any]) -> None:
        """Raise ToolArgumentError if ``args`` break the inputSchema; the check runs in a worker thread
        (the event loop keeps serving the other agents) and a caller's deadline abandons it."""
        check = functools.partial(check_arguments, self._validator, args, self.name)
        await anyio.to_thread.run_sync(check, abandon_on_cancel=True)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return result_from_mcp(await self.call(arguments), self.name, self.max_output_chars)

    async def call(self, arguments: str | Mapping[str, Any] | None) -> types.CallToolResult:
        """Check the arguments and run one tools/call; never raises on a fault of the model, the tool or
        the server: those come back as ``isError`` results whose text starts with ``"Error: "`` and whose
        ``_meta`` names the kind (``{"agentloop/error": "timeout"}``)."""
        try:
            args = self.parse_arguments(arguments)
            started = time.monotonic()
            with anyio.move_on_after(self.timeout_s) as checking:  # the check counts in the call's time
                await self.check_arguments(args)
            if checking.cancelled_caught:
                raise CallFailed(
                    "timeout", f"checking the arguments of tool {self.name!r} took over {self.timeout_s:g} s"
                )
            left = (
                None if self.timeout_s is None else max(self.timeout_s - (time.monotonic() - started), 0.001)
            )
            if self.connection is None:
                return await self._call_detached(args, left)
            try:
                return await self.connection.call_tool(self.mcp_name, args, timeout_s=left)
            except CallFailed as exc:
                if exc.kind != "timeout":
                    raise
                # the call's deadline, not what the check left of it
                raise CallFailed(
                    "timeout", f"tool {self.name!r} did not finish within {self.timeout_s:g} s"
                ) from None
        except ToolArgumentError as exc:
            return error_result("invalid_arguments", str(exc), self.name)
        except CallFailed as exc:
            return error_result(exc.kind, str(exc), self.name)

    async def _call_detached(self, args: dict[str, Any], timeout_s: float | None) -> types.CallToolResult:
        with anyio.move_on_after(timeout_s) as deadline:  # connecting counts in the call's time
            try:
                async with MCPSession(self.server) as conn:
                    return await conn.call_tool(self.mcp_name, args)
            except ToolError as exc:
                raise CallFailed("connection_lost", str(exc)) from None
        assert deadline.cancelled_caught
        raise CallFailed(
            "timeout", f"tool {self.name!r} did not finish within {self.timeout_s:g} s (connecting included)"
        )

    def __repr__(self) -> str:
        return f"<MCPTool {self.name!r} of {self.server.label!r}{'' if self.connection else ' (detached)'}>"


_OPENAI_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def make_tools(
    listed: list[types.Tool],
    server: MCPServer,
    connection: MCPSession | None,
    include: Sequence[str] | None,
    rename: Mapping[str, str] | None,
    timeout_s: float | None,
    max_output_chars: int | None,
) -> list[MCPTool]:
    """MCPTools for the ``listed`` tools (``include``: only these, in that order; ``rename``: MCP name ->
    the name the model sees); ToolDefinitionError names an unknown tool or a name the model API refuses."""
    by_name = {t.name: t for t in listed}
    if isinstance(include, str):
        raise TypeError(f"include must be a list of tool names, got the string {include!r}")
    unknown = sorted(set(include or ()) - set(by_name)) + sorted(set(rename or {}) - set(by_name))
    if unknown:
        raise ToolDefinitionError(
            f"MCP server {server.label!r} has no tool {', '.join(map(repr, unknown))}; it has: {', '.join(by_name) or 'none'}"
        )
    names = list(by_name) if include is None else list(dict.fromkeys(include))
    tools = []
    for mcp_name in names:
        shown = (rename or {}).get(mcp_name, mcp_name)
        if not _OPENAI_NAME.match(shown):
            raise ToolDefinitionError(
                f"MCP server {server.label!r}: tool name {shown!r} is not a valid function name for the model "
                f"(1-64 letters, digits, '_' or '-'); pass rename={{{mcp_name!r}: 'a_valid_name'}} or leave it out with include"
            )
        tools.append(
            MCPTool(
                by_name[mcp_name],
                server,
                connection,
                name=shown,
                timeout_s=timeout_s,
                max_output_chars=max_output_chars,
            )
        )
    return tools
