"""A live session with one MCP server (stdio or streamable HTTP), through the official ``mcp`` SDK.

``StdioServer`` / ``HttpServer`` say where the server is; ``MCPSession`` holds its session:
``async with MCPSession(server) as conn`` connects, initializes and lists the tools, and
``conn.call_tool`` runs one tools/call with a deadline. The public ``MCPConnection``
(``agentloop.tools.mcp``) is an ``MCPSession`` that also makes its tools (``conn.tools()``), so it
lives above ``agentloop.tools.mcp_tool``, whose detached tools open an ``MCPSession`` per call.
A fault becomes ``CallFailed`` with a kind (``timeout``, ``connection_lost``, ``server_error``,
``invalid_output``) that the tool wrapper (``agentloop.tools.mcp_tool``) turns into an error result.

Traps: the session lives in a task owned by the connection (so a transport failure, which the SDK
raises into its own task group, ends that task and never the caller's); a timed-out or cancelled call
is cancelled on the server too (a ``notifications/cancelled``, best effort). Closing is bounded by
``close_timeout_s``: the SDK ends an HTTP session with a ``DELETE`` under the client's 300 s read
timeout, so a server that never answers it held ``__aexit__`` for five minutes; past the bound the
close is abandoned (cancelled) with a warning. A stdio server inherits
only a minimal environment (the SDK's ``HOME``, ``PATH``, ...) plus ``StdioServer.env``.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Self

import anyio
import anyio.abc
import httpx
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from agentloop._version import __version__
from agentloop.errors import ToolError
from agentloop.logging import get_logger

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "CallFailed",
    "HttpServer",
    "MCPServer",
    "MCPSession",
    "StdioServer",
    "describe_error",
    "short",
]

log = get_logger("agentloop.tools.mcp")

DEFAULT_MAX_OUTPUT_CHARS = 1_000_000  # text + base64 images of one result; ToolAgent shows the model less
_MAX_PAGES = 1000  # tools/list pages followed before giving up on a server that keeps paginating


class StdioServer(BaseModel):
    """An MCP server the client starts as a subprocess and talks to over its stdin/stdout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str = Field(description="The executable that starts the server (sys.executable, npx, uvx, ...).")
    args: list[str] = Field(default_factory=list, description="Its command-line arguments.")
    env: dict[str, str] | None = Field(
        default=None,
        description="Variables added to the minimal environment the SDK passes (HOME, PATH, ...).",
    )
    cwd: str | None = Field(default=None, description="Its working folder (None: this process's).")
    name: str | None = Field(default=None, description="A label for logs and errors (default: the command).")

    @property
    def label(self) -> str:
        return self.name or " ".join([Path(self.command).name, *map(shlex.quote, self.args)])[:80]


class HttpServer(BaseModel):
    """An MCP server reached over the streamable HTTP transport (its endpoint, usually ending in /mcp)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="The endpoint, e.g. http://127.0.0.1:8000/mcp.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Sent with every request (e.g. Authorization); never logged."
    )
    name: str | None = Field(default=None, description="A label for logs and errors (default: the URL).")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        return url

    @property
    def label(self) -> str:
        return self.name or self.url


MCPServer = StdioServer | HttpServer


class CallFailed(Exception):
    """A tools/call that ends in an error ToolResult: ``kind`` goes to metrics["error"]."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_CLIENT = types.Implementation(name="agentloop", version=__version__)  # what the server sees in initialize
_LOST = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError, httpx.HTTPError)


class MCPSession:
    """A live session with one MCP server: ``async with MCPSession(server) as conn: conn.listed``.

    The SDK's transport and ``ClientSession`` run in a task owned by this object (started in
    ``__aenter__``, which returns once the server answered ``initialize`` and listed its tools, or
    raises ToolError within ``connect_timeout_s``). If that task ends (server gone, HTTP error,
    ``__aexit__``), calls in flight end with ``connection_lost`` and later calls fail at once.
    """

    def __init__(
        self, server: MCPServer, *, connect_timeout_s: float = 30.0, close_timeout_s: float = 5.0
    ) -> None:
        if not isinstance(server, StdioServer | HttpServer):
            raise TypeError(f"server must be a StdioServer or HttpServer, got {type(server).__name__}")
        self.server = server
        self.connect_timeout_s = connect_timeout_s
        # a stdio server's own shutdown (close stdin, wait 2 s, SIGTERM, wait 2 s, SIGKILL) fits in 5 s
        self.close_timeout_s = close_timeout_s
        self._ended = anyio.Event()  # the owner task finished (session and transport closed)
        self.listed: list[types.Tool] = []  # the server's tools as tools/list gave them
        self._session: ClientSession | None = None
        self._failure: str | None = None  # why the session ended (None while it lives)
        self._closing = anyio.Event()
        self._in_flight: set[anyio.CancelScope] = set()
        self._tg: Any = None

    @property
    def alive(self) -> bool:
        return self._session is not None

    async def __aenter__(self) -> Self:
        if self._tg is not None:
            raise ToolError(
                f"{type(self).__name__} to {self.server.label!r} cannot be entered twice; make a new one"
            )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            with anyio.fail_after(self.connect_timeout_s):
                await self._tg.start(self._run)
        except BaseException as exc:
            self._closing.set()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            if isinstance(exc, TimeoutError):
                raise ToolError(
                    f"MCP server {self.server.label!r} did not answer initialize + tools/list within "
                    f"{self.connect_timeout_s:g} s; check that it starts (run it by hand) or raise connect_timeout_s"
                ) from None
            raise
        if self._failure is not None:
            await self._tg.__aexit__(None, None, None)
            raise ToolError(f"cannot connect to MCP server {self.server.label!r}: {self._failure}")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._closing.set()  # the owner task closes the session and the transport, then ends
        self._tg.start_soon(self._close_within)
        # Not handing the body's exception to the task group: anyio would raise it wrapped in an
        # ExceptionGroup; the owner task raises nothing, so the body's exception propagates as it is.
        await self._tg.__aexit__(None, None, None)

    async def _close_within(self) -> None:
        """Give the owner task ``close_timeout_s`` to close; then cancel it (and say so)."""
        with anyio.move_on_after(self.close_timeout_s):
            await self._ended.wait()
            return
        log.warning(
            "mcp server did not close in time",
            server=self.server.label,
            timeout_s=self.close_timeout_s,
            reason="abandoned the close (an HTTP server that never answers the session's DELETE?)",
        )
        self._tg.cancel_scope.cancel()

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        started = False
        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write, client_info=_CLIENT))
                await session.initialize()
                self.listed = await _list_all(session)
                self._session, started = session, True
                task_status.started()
                await self._closing.wait()
                self._session = None  # no new call starts on a session that is shutting down
                self._failure = "the connection was closed (its `async with` ended)"
        except Exception as exc:  # the transport's own task group raises here, in this task only
            self._failure = describe_error(exc)
            if started:
                log.warning("mcp server lost", server=self.server.label, reason=self._failure)
        finally:
            self._failure = self._failure or "the connection was closed"
            self._session = None
            for scope in list(self._in_flight):
                scope.cancel()
            if not started:
                task_status.started()
            self._ended.set()

    def _transport(self) -> Any:
        server = self.server
        if isinstance(server, StdioServer):
            params = StdioServerParameters(
                command=server.command, args=server.args, env=server.env, cwd=server.cwd
            )
            return stdio_client(params)
        headers = {k: v.get_secret_value() for k, v in server.headers.items()}
        client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30.0, read=300.0))
        return _http_transport(server.url, client)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float | None = None
    ) -> types.CallToolResult:
        """One tools/call; raises CallFailed (timeout, connection_lost, server_error, invalid_output)."""
        session = self._session
        if session is None:
            raise CallFailed(
                "connection_lost", f"MCP server {self.server.label!r} is not connected: {self._failure}"
            )
        # The id session.call_tool is about to use: nothing awaits between this read and its use.
        request_id = getattr(session, "_request_id", None)
        finished = False
        with anyio.CancelScope() as lost:
            self._in_flight.add(lost)
            try:
                with anyio.move_on_after(timeout_s) as deadline:
                    result = await session.call_tool(name, arguments)  # the SDK's read timeout stays off
                    finished = True
            except McpError as exc:
                if exc.error.code != types.CONNECTION_CLOSED:
                    raise CallFailed(
                        "server_error",
                        f"MCP server {self.server.label!r} refused tool {name!r} "
                        f"(JSON-RPC error {exc.error.code}: {short(exc.error.message)})",
                    ) from None
                self._failure = self._failure or "the server closed the connection (did its process exit?)"
                self._session = None
            except RuntimeError as exc:  # the SDK's check of structured output against outputSchema
                raise CallFailed("invalid_output", f"tool {name!r}: {short(str(exc))}") from None
            except _LOST as exc:
                self._failure = self._failure or describe_error(exc)
                self._session = None
            except Exception as exc:  # an answer the SDK cannot read (its pydantic validation), or worse
                raise CallFailed(
                    "server_error", f"MCP server {self.server.label!r}, tool {name!r}: {describe_error(exc)}"
                ) from None
            finally:
                self._in_flight.discard(lost)
                if not finished and self._session is not None and request_id is not None:
                    await self._cancel_request(session, request_id)  # a timeout or the caller's cancel
        if finished:
            return result
        if deadline.cancelled_caught and self._session is not None:
            raise CallFailed("timeout", f"tool {name!r} did not finish within {timeout_s:g} s")
        self._session = None
        raise CallFailed(
            "connection_lost",
            f"MCP server {self.server.label!r} is not reachable ({self._failure}); tool {name!r} cannot run now",
        )

    async def _cancel_request(self, session: ClientSession, request_id: int) -> None:
        """Tell the server to stop a request we gave up on (best effort, never blocks long)."""
        note = types.CancelledNotification(params=types.CancelledNotificationParams(requestId=request_id))
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await session.send_notification(types.ClientNotification(note))
            except Exception as exc:
                log.debug("mcp cancel not sent", server=self.server.label, error=describe_error(exc))


@asynccontextmanager
async def _http_transport(url: str, client: httpx.AsyncClient) -> AsyncIterator[tuple[Any, Any]]:
    async with client, streamable_http_client(url, http_client=client) as (read, write, _):
        yield read, write


async def _list_all(session: ClientSession) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        tools.extend(page.tools)
        if not page.nextCursor:
            return tools
        cursor = page.nextCursor
    raise ToolError(f"tools/list returned more than {_MAX_PAGES} pages")


def describe_error(exc: BaseException) -> str:
    """An exception (or a group of one) in one line, for logs and error results."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, McpError) and exc.error.code == types.CONNECTION_CLOSED:
        return "the server closed the connection (did its process exit?)"
    return f"{type(exc).__name__}: {short(str(exc))}"


def short(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"
