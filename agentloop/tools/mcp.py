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

Each tool's schema is the server's ``inputSchema``, unchanged (``openai_schema()`` carries name,
description and parameters as listed). The model's arguments are checked against it (JSON Schema,
``jsonschema``) before anything is sent; a call never raises on a fault but returns an error
``ToolResult`` (``"Error: ..."``, ``metrics["error"]``): ``invalid_arguments``, ``tool_error`` (the
server's ``isError``), ``server_error`` (a JSON-RPC error), ``invalid_output``, ``timeout`` (the server
is told to cancel the request) and ``connection_lost`` (the server died or the session was closed;
later calls fail at once with the same reason).

Traps: the session lives in a task of the ``async with`` (so a transport failure, which the SDK raises
into its own task group, ends that task and never the caller's), hence the tools of ``mcp_tools`` are
usable only inside it. ``max_output_chars`` bounds what reaches the model and the spans, not what the
SDK reads: a server is trusted not to send gigabytes. A stdio server inherits only a minimal
environment (the SDK's ``HOME``, ``PATH``, ...) plus ``StdioServer.env``.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import jsonschema
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from referencing import Registry

from agentloop.errors import ToolArgumentError, ToolDefinitionError, ToolError
from agentloop.logging import get_logger
from agentloop.tools.base import DEFAULT_TIMEOUT_S, BaseTool, ToolResponse, ToolResult
from agentloop.tools.schema import decode_arguments

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

log = get_logger("agentloop.tools.mcp")

DEFAULT_MAX_OUTPUT_CHARS = 1_000_000  # text + base64 images of one result; ToolAgent shows the model less
_MAX_PAGES = 1000  # tools/list pages followed before giving up on a server that keeps paginating
_MAX_PROBLEMS = 5  # argument problems named in one error message
ERROR_META = "agentloop/error"  # the _meta key of an error result MCPTool.call made: the kind of fault


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


class _CallFailed(Exception):
    """A call that ends in an error ToolResult: ``kind`` goes to metrics["error"]."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_CLIENT = types.Implementation(name="agentloop", version="0.1.0")  # what the server sees in initialize
_LOST = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError, httpx.HTTPError)


class MCPConnection:
    """A live session with one MCP server: ``async with MCPConnection(server) as conn: conn.tools()``.

    The SDK's transport and ``ClientSession`` run in a task owned by this object (started in
    ``__aenter__``, which returns once the server answered ``initialize`` and listed its tools, or
    raises ToolError within ``connect_timeout_s``). If that task ends (server gone, HTTP error,
    ``__aexit__``), calls in flight end with ``connection_lost`` and later calls fail at once.
    """

    def __init__(self, server: MCPServer, *, connect_timeout_s: float = 30.0) -> None:
        if not isinstance(server, StdioServer | HttpServer):
            raise TypeError(f"server must be a StdioServer or HttpServer, got {type(server).__name__}")
        self.server = server
        self.connect_timeout_s = connect_timeout_s
        self.listed: list[types.Tool] = []  # the server's tools as tools/list gave them
        self._session: ClientSession | None = None
        self._failure: str | None = None  # why the session ended (None while it lives)
        self._closing = anyio.Event()
        self._in_flight: set[anyio.CancelScope] = set()
        self._tg: Any = None

    @property
    def alive(self) -> bool:
        return self._session is not None

    async def __aenter__(self) -> MCPConnection:
        if self._tg is not None:
            raise ToolError(f"MCPConnection to {self.server.label!r} cannot be entered twice; make a new one")
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
        # Not handing the body's exception to the task group: anyio would raise it wrapped in an
        # ExceptionGroup; the owner task raises nothing, so the body's exception propagates as it is.
        await self._tg.__aexit__(None, None, None)

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
            self._failure = _describe(exc)
            if started:
                log.warning("mcp server lost", server=self.server.label, reason=self._failure)
        finally:
            self._failure = self._failure or "the connection was closed"
            self._session = None
            for scope in list(self._in_flight):
                scope.cancel()
            if not started:
                task_status.started()

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

    def tools(
        self,
        include: Sequence[str] | None = None,
        *,
        rename: Mapping[str, str] | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> list[MCPTool]:
        """The server's tools bound to this session (``include``: only these, by MCP name)."""
        return _make_tools(self.listed, self.server, self, include, rename, timeout_s, max_output_chars)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float | None = None
    ) -> types.CallToolResult:
        """One tools/call; raises _CallFailed (timeout, connection_lost, server_error, invalid_output)."""
        session = self._session
        if session is None:
            raise _CallFailed(
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
                    raise _CallFailed(
                        "server_error",
                        f"MCP server {self.server.label!r} refused tool {name!r} "
                        f"(JSON-RPC error {exc.error.code}: {_short(exc.error.message)})",
                    ) from None
                self._failure = self._failure or "the server closed the connection (did its process exit?)"
                self._session = None
            except RuntimeError as exc:  # the SDK's check of structured output against outputSchema
                raise _CallFailed("invalid_output", f"tool {name!r}: {_short(str(exc))}") from None
            except _LOST as exc:
                self._failure = self._failure or _describe(exc)
                self._session = None
            except Exception as exc:  # an answer the SDK cannot read (its pydantic validation), or worse
                raise _CallFailed(
                    "server_error", f"MCP server {self.server.label!r}, tool {name!r}: {_describe(exc)}"
                ) from None
            finally:
                self._in_flight.discard(lost)
                if not finished and self._session is not None and request_id is not None:
                    await self._cancel_request(session, request_id)  # a timeout or the caller's cancel
        if finished:
            return result
        if deadline.cancelled_caught and self._session is not None:
            raise _CallFailed("timeout", f"tool {name!r} did not finish within {timeout_s:g} s")
        self._session = None
        raise _CallFailed(
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
                log.debug("mcp cancel not sent", server=self.server.label, error=_describe(exc))


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


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, McpError) and exc.error.code == types.CONNECTION_CLOSED:
        return "the server closed the connection (did its process exit?)"
    return f"{type(exc).__name__}: {_short(str(exc))}"


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


# ---------------------------------------------------------------- arguments


def _where(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(err: jsonschema.ValidationError) -> str:
    where, kind, instance = _where(err.absolute_path), err.validator, err.instance
    field = f"argument {where!r}" if where else "arguments"
    if kind == "required" and isinstance(instance, dict):
        missing = [r for r in err.validator_value if r not in instance]
        names = ", ".join(repr(m) for m in missing)
        return (
            f"missing required argument {names}" if not where else f"{field}: missing required field {names}"
        )
    if kind == "additionalProperties" and isinstance(instance, dict) and isinstance(err.schema, dict):
        known = list(err.schema.get("properties") or {})
        extra = [k for k in instance if k not in known]
        return (
            f"unexpected {'argument' if not where else f'field in {where!r}:'} "
            f"{', '.join(repr(e) for e in extra)} (known: {', '.join(known) or 'none'})"
        )
    if kind == "type":
        expected = (
            err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        )
        return f"{field}: expected {expected}, got {_short(json.dumps(instance, default=repr), 80)}"
    if kind == "enum":
        return f"{field}: expected {' or '.join(json.dumps(v, default=repr) for v in err.validator_value)}, got {_short(json.dumps(instance, default=repr), 80)}"
    return f"{field}: {_short(err.message, 200)}"


def check_arguments(
    validator: jsonschema.protocols.Validator, arguments: dict[str, Any], tool_name: str
) -> None:
    """Raise ToolArgumentError naming up to five problems of ``arguments`` against the tool's schema."""
    errors = sorted(
        validator.iter_errors(arguments),
        key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))),
    )
    if not errors:
        return
    problems = list(dict.fromkeys(_problem(e) for e in errors))
    more = len(problems) - _MAX_PROBLEMS
    text = "; ".join(problems[:_MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    raise ToolArgumentError(f"invalid arguments for tool {tool_name!r}: {text}")


def _validator(schema: dict[str, Any], tool_name: str, server: str) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ToolDefinitionError(
            f"MCP server {server!r}: tool {tool_name!r} has an invalid inputSchema ({_short(exc.message, 200)}); "
            "leave it out with include=[...]"
        ) from None
    return cls(schema, registry=Registry())  # an empty registry: no $ref is fetched from the network


# ---------------------------------------------------------------- results


def result_from_mcp(
    result: types.CallToolResult, tool_name: str, max_output_chars: int | None = None
) -> ToolResult:
    """An MCP tool result as a ToolResult: text blocks joined, images as data: URLs, the rest described.

    ``isError`` results become ``"Error: ..."`` with ``metrics["error"] = "tool_error"``. Text past
    ``max_output_chars`` is cut (marked), and images that do not fit what is left are replaced by a note.
    """
    budget = max_output_chars if max_output_chars is not None else float("inf")
    texts: list[str] = []
    images: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.ImageContent) and block.mimeType.startswith("image/"):
            images.append(f"data:{block.mimeType};base64,{block.data}")
        elif isinstance(block, types.EmbeddedResource):
            res = block.resource
            if isinstance(res, types.TextResourceContents):
                texts.append(res.text)
            elif (res.mimeType or "").startswith("image/"):
                images.append(f"data:{res.mimeType};base64,{res.blob}")
            else:
                texts.append(f"[resource {res.uri} omitted: {res.mimeType or 'binary data'}]")
        elif isinstance(block, types.ResourceLink):
            texts.append(f"[resource {block.uri}{f' ({block.name})' if block.name else ''}]")
        else:
            texts.append(f"[{block.type} content omitted: {getattr(block, 'mimeType', None) or 'no type'}]")
    if not texts and not images and result.structuredContent is not None:
        texts.append(json.dumps(result.structuredContent, ensure_ascii=False))
    text = "\n".join(texts)
    metrics: dict[str, Any] = {}
    if len(text) > budget:
        dropped = len(text) - int(budget)
        text = text[: int(budget)] + f"... [truncated {dropped} chars]"
        metrics["truncated_chars"] = dropped
    kept: list[str] = []
    used = len(text)
    for image in images:
        if used + len(image) <= budget:
            kept.append(image)
            used += len(image)
        else:
            text += f"\n[image omitted: {len(image)} chars over the {max_output_chars} char output limit]"
            metrics["images_omitted"] = metrics.get("images_omitted", 0) + 1
    if result.isError:
        metrics["error"] = (result.meta or {}).get(ERROR_META, "tool_error")
        text = text if text.startswith("Error") else f"Error: {text or f'tool {tool_name!r} failed'}"
    return ToolResult(response=ToolResponse(text=text, images=kept or None), metrics=metrics)


def _error_result(kind: str, message: str, tool: str) -> types.CallToolResult:
    log.warning("mcp tool call failed", tool=tool, error=kind, message=message[:200])
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"Error: {message}")],
        isError=True,
        _meta={ERROR_META: kind},
    )


# ---------------------------------------------------------------- tools


class MCPTool(BaseTool):
    """One tool of an MCP server. Bound to an ``MCPConnection`` (``mcp_tools``), calls share its session;
    detached (``load_mcp_tools``, or unpickled), each call opens a session of its own."""

    def __init__(
        self,
        spec: types.Tool,
        server: MCPServer,
        connection: MCPConnection | None = None,
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
        self._validator = _validator(self.parameters, spec.name, server.label)

    def __getstate__(
        self,
    ) -> dict[str, Any]:  # a live session does not travel: unpickled, the tool is detached
        state = self.__dict__.copy()
        state["connection"] = None
        del state["_validator"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._validator = _validator(self.parameters, self.mcp_name, self.server.label)

    def parse_arguments(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Decode the model's arguments and check them against the server's inputSchema."""
        args = decode_arguments(raw, self.name)
        check_arguments(self._validator, args, self.name)
        return args

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return result_from_mcp(await self.call(arguments), self.name, self.max_output_chars)

    async def call(self, arguments: str | Mapping[str, Any] | None) -> types.CallToolResult:
        """Check the arguments and run one tools/call; never raises on a fault of the model, the tool or
        the server: those come back as ``isError`` results whose text starts with ``"Error: "`` and whose
        ``_meta`` names the kind (``{"agentloop/error": "timeout"}``)."""
        try:
            args = self.parse_arguments(arguments)
            if self.connection is not None:
                return await self.connection.call_tool(self.mcp_name, args, timeout_s=self.timeout_s)
            return await self._call_detached(args)
        except ToolArgumentError as exc:
            return _error_result("invalid_arguments", str(exc), self.name)
        except _CallFailed as exc:
            return _error_result(exc.kind, str(exc), self.name)

    async def _call_detached(self, args: dict[str, Any]) -> types.CallToolResult:
        with anyio.move_on_after(self.timeout_s) as deadline:  # connecting counts in the call's time
            try:
                async with MCPConnection(self.server) as conn:
                    return await conn.call_tool(self.mcp_name, args)
            except ToolError as exc:
                raise _CallFailed("connection_lost", str(exc)) from None
        assert deadline.cancelled_caught
        raise _CallFailed(
            "timeout", f"tool {self.name!r} did not finish within {self.timeout_s:g} s (connecting included)"
        )

    def __repr__(self) -> str:
        return f"<MCPTool {self.name!r} of {self.server.label!r}{'' if self.connection else ' (detached)'}>"


_OPENAI_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _make_tools(
    listed: list[types.Tool],
    server: MCPServer,
    connection: MCPConnection | None,
    include: Sequence[str] | None,
    rename: Mapping[str, str] | None,
    timeout_s: float | None,
    max_output_chars: int | None,
) -> list[MCPTool]:
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
    return _make_tools(listed, server, None, include, rename, timeout_s, max_output_chars)
