"""Whether an HTTP client is still connected, known without asking the server each time.

``ClientWatch`` reads the request's next ASGI message in a task of its own once the body has been
read: the server delivers ``http.disconnect`` when the client closes its connection, and
``gone()`` then answers True. Reading the answer is a flag read.

Why not Starlette's ``Request.is_disconnected``: it awaits ``receive`` inside an already-cancelled
cancel scope, which costs an event-loop iteration (~40 us of CPU) per call. The proxy asks once per
call before recording it and every ``DISCONNECT_POLL_S`` while the engine generates. In a burst of
128 requests each of those calls delays the requests behind it
(benchmarks/results/proxy_cpu_profile.json).

Ownership: the watcher task belongs to the ``with`` block; leaving the block cancels it, before the
response is sent. Use it only after the body has been read in full, since it consumes the messages
that come after the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any

import structlog

log = structlog.get_logger("agentloop.proxy")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # an ASGI receive callable


class ClientWatch:
    """Watches one request's connection until the ``with`` block ends (module docstring)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._left = False
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass  # nothing else is expected once the body is read; keep waiting for the disconnect
        except Exception as exc:  # the server broke its side of ASGI: we cannot tell, so not gone
            log.warning("cannot watch the client's connection", error=repr(exc)[:200])
            return
        self._left = True

    async def gone(self) -> bool:
        """True once the client has closed its connection."""
        return self._left

    def __enter__(self) -> ClientWatch:
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
