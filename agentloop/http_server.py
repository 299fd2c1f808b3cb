"""One HTTP server lifecycle for the proxy and the store server: bind, serve, stop.

``EmbeddedServer`` runs one ASGI app under uvicorn inside the caller's event loop, on a socket it
binds itself (so port 0 gives the real port before the first request), with the connection limits of
``agentloop.http_limits`` and without uvicorn's signal handlers (Ctrl+C belongs to the program that
embeds the server: the trainer, the runner, ``agentloop serve``).

Lifecycle (``ServerState``): CREATED -> RUNNING (``serve`` reported the port through
``task_status``, or ``start`` returned it) -> STOPPED (``stop``, or the server ended); a server runs
once. ``serve(task_status=...)`` fits an anyio task group; ``start``/``stop`` run it as a task of
the current loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from enum import StrEnum
from typing import Any

import anyio
import uvicorn
from anyio.abc import TaskStatus

from agentloop.http_limits import HttpLimits, limited_protocol, open_connections
from agentloop.logging import get_logger

log = get_logger(__name__)

_MAX_OPEN_FILES = 1 << 16


class ServerState(StrEnum):
    CREATED = "created"  # constructed; no socket yet
    RUNNING = "running"  # listening
    STOPPED = "stopped"  # terminal: closed; a server is not restarted


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most 65536); returns the
    soft limit now in force. Every agent connection holds a socket on each side until it closes, and
    agents that never close their client keep it until garbage collection: at a few hundred agents
    a step, a common 1024 default runs out, and then the server stops accepting connections while
    clients wait for their timeout."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("raised_open_file_limit", soft_before=soft, soft=target, hard=hard)
        return target
    return soft


def bind_socket(host: str, port: int, what: str, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); OSError names ``what`` failed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0): asyncio then sets TCP_NODELAY on accepted connections; without it
    # Nagle + delayed ACK stall every keep-alive response by 40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(f"{what} cannot bind {host}:{port}: {exc}") from exc
    sock.setblocking(False)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EmbeddedServer:
    """Serve ``app`` on ``host:port`` in the running event loop (module docstring).

    Args:
        what: the server's name in errors and logs ("the proxy", "the store server").
        limits: connection limit, header and body deadlines, header size (``HttpLimits()``).
        keep_alive_s: how long an idle keep-alive connection stays open.
        graceful_s: on ``stop``, how long in-flight requests may take to finish; 0: close at once
            (the store's long-poll waits would otherwise hold the stop).
        background: a coroutine function run while the server runs, cancelled when it ends.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        host: str,
        port: int,
        *,
        what: str,
        limits: HttpLimits | None = None,
        backlog: int = 4096,
        keep_alive_s: float = 30.0,
        graceful_s: float = 5.0,
        background: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        self.app, self.host, self.what = app, host, what
        self.limits = limits or HttpLimits()
        self.backlog, self.keep_alive_s, self.graceful_s = backlog, keep_alive_s, graceful_s
        self.background = background
        self.state = ServerState.CREATED
        self._requested_port = port
        self._port: int | None = None
        self._protocol = limited_protocol(self.limits)  # counts this server's connections
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.what} has no port yet; start it first")
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections the server holds open now (at most ``limits.max_connections``)."""
        return open_connections(self._protocol)

    async def serve(
        self,
        *,
        on_bound: Callable[[int], Any] | None = None,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until ``stop()``: bind (``on_bound(port)`` then runs before the first request is
        accepted), serve, ``task_status.started(port)`` once accepting."""
        if self.state is not ServerState.CREATED:
            raise RuntimeError(f"{self.what} starts once; it is {self.state.value}")
        raise_open_file_limit()
        sock = bind_socket(self.host, self._requested_port, self.what, self.backlog)
        self._port = sock.getsockname()[1]
        if on_bound is not None:
            on_bound(self._port)
        config = uvicorn.Config(
            self.app, http=self._protocol, ws="none", log_config=None, log_level="warning", access_log=False,
            lifespan="off", proxy_headers=False, timeout_keep_alive=int(self.keep_alive_s),
            backlog=self.backlog, timeout_graceful_shutdown=int(self.graceful_s) or None,
        )  # fmt: skip
        self._server = server = _Uvicorn(config)
        self.state = ServerState.RUNNING
        try:
            async with anyio.create_task_group() as tg:

                async def serve_then_end_background() -> None:
                    await server.serve([sock])
                    tg.cancel_scope.cancel()  # the background task ends with the server

                tg.start_soon(serve_then_end_background)
                if self.background is not None:
                    tg.start_soon(self.background)
                while not server.started and not server.should_exit:
                    await anyio.sleep(0.005)
                log.info("listening", server=self.what, port=self._port)
                task_status.started(self._port)
        finally:
            self.state = ServerState.STOPPED
            sock.close()

    async def start(self, on_bound: Callable[[int], Any] | None = None) -> int:
        """Serve as a task of the running loop; returns the port once the server accepts connections
        (raises what binding or starting raised)."""
        if self._task is not None:
            raise RuntimeError(f"{self.what} is already started; call stop() first")
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    ready.set_result(await tg.start(functools.partial(self.serve, on_bound=on_bound)))
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._task = asyncio.create_task(run(), name=f"agentloop-server-{id(self)}")
        try:
            return await ready
        except BaseException:
            self._task = None
            raise

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to ``graceful_s``), close the socket."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = self.graceful_s <= 0
        task, self._task = self._task, None
        if task is not None:
            with anyio.move_on_after(self.graceful_s + 5):
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
            if not task.done():  # pragma: no cover - graceful shutdown overran
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self.state = ServerState.STOPPED
