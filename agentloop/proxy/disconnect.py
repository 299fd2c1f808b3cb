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

What the proxy does with ``gone`` (a ``ClientGone``): ``_unless_gone`` runs a generation and
cancels it once its client left (engine_call.py), ``_has_left`` asks before recording (service.py),
and ``client_gone_error`` (499) ends such a request without a record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any, TypeVar

import anyio
import structlog

from agentloop.proxy.schemas import ProxyError

log = structlog.get_logger("agentloop.proxy")
T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # an ASGI receive callable
ClientGone = Callable[[], Awaitable[bool]]  # true once the HTTP client has closed its connection
DISCONNECT_POLL_S = 0.5  # how often a running generation asks whether its client is still there


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


def client_gone_error() -> ProxyError:
    # 499 (nginx's "client closed request"): nobody reads it; it ends the request without a record
    return ProxyError(
        499, "the client closed the connection before the answer was ready; the call was not recorded",
        code="client_closed",
    )  # fmt: skip


async def _has_left(client_gone: ClientGone) -> bool:
    """What ``client_gone()`` says; a check that fails cannot tell, so the client counts as there."""
    try:
        return await client_gone()
    except Exception as exc:
        log.warning("client check failed; taken as still connected", error=repr(exc)[:200])
        return False


async def _unless_gone(work: Awaitable[T], client_gone: ClientGone) -> T | None:
    """``work``'s result, or None once ``client_gone()`` says the client left (``work`` is cancelled).

    ``work`` runs in this very task, so the engine gets the request at once. A timer asks
    ``client_gone`` every ``DISCONNECT_POLL_S`` (first after one period: the client has just sent its
    request) in a short task of its own, and cancels ``work``'s scope once the client left; the
    function's exit cancels the timer and any check still running. Cheaper than a watcher task in a
    task group that asks at once: that cost ~0.1 ms of event-loop CPU per request, 9% of the proxy's
    work in a burst of 128 requests (benchmarks/results/proxy_cpu_profile.json).
    """
    loop = asyncio.get_running_loop()
    checks: set[asyncio.Task[None]] = set()
    timer: asyncio.TimerHandle | None = None
    with anyio.CancelScope() as scope:

        async def check() -> None:
            nonlocal timer
            if await _has_left(client_gone):
                scope.cancel()
            else:
                timer = loop.call_later(DISCONNECT_POLL_S, poll)

        def poll() -> None:
            task = loop.create_task(check())
            checks.add(task)
            task.add_done_callback(checks.discard)

        timer = loop.call_later(DISCONNECT_POLL_S, poll)
        try:
            return await work
        finally:
            timer.cancel()  # the latest one: a check that ran has replaced it
            if checks:
                for task in checks:
                    task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(checks)
    return None
