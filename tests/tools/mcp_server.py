"""A real MCP server for the MCP tool tests, built with the official SDK's FastMCP.

Run as ``python mcp_server.py stdio`` (the client starts it and talks over its stdin/stdout) or
``python mcp_server.py http PORT`` (streamable HTTP on 127.0.0.1:PORT, path ``/mcp``; ``http-ignoring-delete``:
the same, but the session's closing ``DELETE`` is never answered).

Its tools cover what a client must handle: typed arguments with defaults, enums and nested objects
(``search``), text, structured and image results, a tool that raises (``boom``: an ``isError``
result), one that hangs until cancelled (``sleep``, which counts its cancellations for ``stats``),
one that kills the server (``crash``), large output (``big``) and per-session state (``counter``), and the HTTP headers a client sent (``header``).
"""

from __future__ import annotations

import base64
import os
import sys
from typing import Annotated, Any, Literal

import anyio
from mcp.server.fastmcp import Context, FastMCP, Image
from pydantic import BaseModel, Field

# A 1x1 transparent PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)

server = FastMCP("agentloop-test", log_level="WARNING")
_stats = {"sleep_started": 0, "sleep_cancelled": 0, "count": 0, "calls": 0}  # "calls": add, echo, search


class Filters(BaseModel):
    """Narrow a search."""

    tags: list[str] = Field(description="Tags that must all match.")
    year: int | None = Field(default=None, description="Publication year.")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    _stats["calls"] += 1
    return a + b


@server.tool()
def echo(text: str, times: Annotated[int, Field(ge=1, le=5, description="Repeat count.")] = 1) -> str:
    """Repeat a text."""
    _stats["calls"] += 1
    return " ".join([text] * times)


@server.tool()
def search(query: str, filters: Filters, order: Literal["new", "old"] = "new") -> dict[str, object]:
    """Search the catalogue."""
    _stats["calls"] += 1
    return {"query": query, "tags": filters.tags, "year": filters.year, "order": order}


@server.tool()
def image() -> Image:
    """Return a 1x1 PNG."""
    return Image(data=PNG, format="png")


@server.tool()
def boom(x: int) -> str:
    """Always fails."""
    raise ValueError(f"kaboom {x}")


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    _stats["sleep_started"] += 1
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        _stats["sleep_cancelled"] += 1
        raise
    return f"slept {seconds}"


@server.tool()
def stats() -> dict[str, int]:
    """Counters of this server process."""
    return dict(_stats)


@server.tool()
def counter() -> int:
    """Increase this server's counter and return it."""
    _stats["count"] += 1
    return _stats["count"]


@server.tool()
def big(n: int) -> str:
    """Return n characters."""
    return "x" * n


@server.tool()
def header(name: str, ctx: Context) -> str:  # type: ignore[type-arg]
    """The value of one HTTP request header ('' over stdio)."""
    request = ctx.request_context.request
    return str(request.headers.get(name, "")) if request is not None else ""  # type: ignore[attr-defined]


@server.tool()
def crash() -> str:
    """Kill the server process."""
    os._exit(3)


def ignore_delete(app: Any) -> Any:
    """The app, except that a DELETE (the client ending its session) is never answered."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "DELETE":
            await anyio.sleep_forever()
        await app(scope, receive, send)

    return wrapped


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.settings.port = int(sys.argv[2])
        server.run("streamable-http")
    elif sys.argv[1:2] == ["http-ignoring-delete"]:  # a server that never answers the session's DELETE
        import uvicorn

        app = ignore_delete(server.streamable_http_app())
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    else:
        server.run("stdio")
