"""Limits that keep an HTTP server answering while hostile clients hold connections open.

uvicorn alone waits forever for a connection's first byte and for the rest of a half-sent header,
buffers a header line of any length (httptools keeps it in memory until the line ends), and has no
deadline on a request body. ``limited_protocol(limits)`` is a uvicorn HTTP/1.1 protocol class
(httptools) that adds, per connection:

=====================  ======================================================================
header deadline        the request line and headers must arrive within ``header_timeout_s`` of
                       the connection opening (first request) or of the request's first byte
                       (later ones); else 408 (nothing sent yet: the socket is just closed)
header size            more than ``max_header_bytes`` before the blank line ends the headers: 431
body deadline          the body must arrive within ``body_timeout_s`` of the headers; else 408
                       (when the app has not answered yet) and the connection closes
connection limit       at ``max_connections`` open connections a new one evicts the oldest one
                       that never completed a request's headers, else the oldest with no request
                       in flight (keep-alive); when every connection is answering a request the
                       new one gets 503 and is closed
=====================  ======================================================================

So an idle or slow connection costs at most its deadline, a header at most ``max_header_bytes``
(counted before the parser sees the bytes), and a flood of unauthenticated sockets cannot push out a client that is
being answered. The defaults suit both servers; nobody needs to change them::

    config = uvicorn.Config(app, http=limited_protocol(HttpLimits()), ...)

Traps: the deadlines are event-loop timers, so a loop blocked for longer than a deadline (a long
tokenisation) makes them fire late, never early: asyncio runs the callbacks of sockets that became
readable before timers that came due in the same iteration.

``check_bind(host, key, what)`` is the other server rule: no non-loopback address without a key.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HttpLimits", "check_bind", "is_loopback", "limited_protocol", "open_connections"]


@dataclass(frozen=True)
class HttpLimits:
    """Per-server limits on connections and on how long and how large a request may be in arriving."""

    # open sockets; a fd and ~4 KiB each when idle. 4096 keeps hundreds of agents' keep-alive
    # connections (each client pool holds several) well under it while capping an idle-socket flood
    max_connections: int = 4096
    # clients send request line and headers in one write; 10 s covers a congested network
    header_timeout_s: float = 10.0
    # openai/httpx send ~1 KiB of headers (a bearer key included); nginx's default is 4 x 8 KiB
    max_header_bytes: int = 32 * 1024
    # a 32 MiB body (the trainer proxy's limit) needs ~1 MiB/s to make it
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(
                f"header_timeout_s and body_timeout_s must be > 0, got {self.header_timeout_s}, "
                f"{self.body_timeout_s}"
            )


class _Phase(IntEnum):
    """Where a connection's current request is (ordered: each request goes up, then starts over)."""

    WAITING = 0  # no byte of a request yet (a new connection, or a finished request's keep-alive)
    HEADERS = 1  # the request line and headers are arriving
    BODY = 2  # headers complete (the app runs); the body is arriving
    RECEIVED = 3  # the whole request arrived; the app answers


def _simple_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Registry:
    """One server's open connections, oldest first: ``fresh`` ones have not completed a request's
    headers yet (the first to go when the limit is reached), ``known`` ones have."""

    def __init__(self) -> None:
        self.fresh: OrderedDict[_LimitedHttpTools, None] = OrderedDict()
        self.known: OrderedDict[_LimitedHttpTools, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.fresh) + len(self.known)

    def discard(self, conn: _LimitedHttpTools) -> None:
        self.fresh.pop(conn, None)
        self.known.pop(conn, None)

    def evict_one(self) -> bool:
        """Close the oldest fresh connection, else the oldest with no request in flight; False when
        every connection is answering a request. O(1) while fresh ones remain."""
        victim = next(iter(self.fresh), None)
        if victim is None:
            victim = next((c for c in self.known if not c.busy()), None)
        if victim is None:
            return False
        self.discard(victim)
        victim.close_now()
        return True


class _LimitedHttpTools(HttpToolsProtocol):
    """HttpToolsProtocol with the module docstring's limits; ``limited_protocol`` makes one per server."""

    limits: ClassVar[HttpLimits]
    registry: ClassVar[_Registry]  # a subclass per server (limited_protocol), so per server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _Phase.WAITING
        self._header_bytes = 0  # bytes of the current request's line and headers so far
        self._tail = b""  # the last 3 header bytes: the blank line may straddle two reads
        self._deadline: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        registry = type(self).registry
        if len(registry) >= self.limits.max_connections and not registry.evict_one():
            transport.write(_simple_response(503, "Service Unavailable", "too many open connections"))
            transport.close()
            return
        registry.fresh[self] = None
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        type(self).registry.discard(self)
        super().connection_lost(exc)

    def busy(self) -> bool:
        """A request is being answered (the connection is not evicted)."""
        return self.cycle is not None and not self.cycle.response_complete

    def close_now(self) -> None:
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()

    # ------------------------------------------------------------ deadlines

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._phase == _Phase.HEADERS:
            s = self.limits.header_timeout_s
            self._refuse(408, "Request Timeout", f"the request headers did not arrive within {s:g}s")
        elif self._phase == _Phase.BODY:
            s = self.limits.body_timeout_s
            self._refuse(408, "Request Timeout", f"the request body did not arrive within {s:g}s")
        else:  # nothing sent on a new connection: close it without an answer
            self.transport.close()

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` where the connection is free to (no other answer started or in flight),
        then close it; an app still waiting for the body gets ``http.disconnect``."""
        cycle = self.cycle
        in_flight = cycle is not None and not cycle.response_complete
        if self._phase == _Phase.BODY:  # the cycle is this request's
            can_answer = cycle is None or not cycle.response_started
        else:  # this request has no cycle yet; one in flight is an earlier (pipelined) request's
            can_answer = not in_flight
        if can_answer:
            self.transport.write(_simple_response(status, reason, message))
        self.close_now()

    # ------------------------------------------------------------ parser hooks

    def data_received(self, data: bytes) -> None:
        if self._phase != _Phase.BODY:  # these bytes start or continue a request's headers
            ends = _header_end(self._tail, data)  # bytes of ``data`` up to the blank line, or None
            if ends is None:
                self._header_bytes += len(data)
                self._tail = (self._tail + data[-3:])[-3:]
            else:
                self._header_bytes += ends
                self._tail = b""
            if self._header_bytes > self.limits.max_header_bytes:  # refused before the parser buffers it
                limit = self.limits.max_header_bytes
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request line and headers exceed {limit} bytes")  # fmt: skip
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _Phase.HEADERS
        if self._deadline is None:  # a keep-alive connection's next request: its own deadline
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._phase = _Phase.BODY
        self._header_bytes, self._tail = 0, b""
        registry = type(self).registry
        if self in registry.fresh:  # its first request: no longer the first to be evicted
            del registry.fresh[self]
            registry.known[self] = None
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = _Phase.RECEIVED
        self._header_bytes, self._tail = 0, b""
        self._disarm()
        super().on_message_complete()


def _header_end(tail: bytes, data: bytes) -> int | None:
    """How many bytes of ``data`` end the headers (the blank line included), ``tail`` being the last
    bytes before it; None when the blank line is not in ``data``. Does not copy ``data``."""
    straddling = (tail + data[:3]).find(b"\r\n\r\n")
    if straddling >= 0:
        return straddling + 4 - len(tail)
    inside = data.find(b"\r\n\r\n")
    return inside + 4 if inside >= 0 else None


def limited_protocol(limits: HttpLimits | None = None) -> type[asyncio.Protocol]:
    """A uvicorn protocol class (``uvicorn.Config(http=...)``) enforcing ``limits``; one per server,
    since the connection limit counts that server's connections."""
    return type(
        "LimitedHttpToolsProtocol",
        (_LimitedHttpTools,),
        {"limits": limits or HttpLimits(), "registry": _Registry()},
    )


def open_connections(protocol: type[asyncio.Protocol]) -> int:
    """How many connections a ``limited_protocol`` class's server holds open now."""
    registry = getattr(protocol, "registry", None)
    if not isinstance(registry, _Registry):
        raise TypeError(f"{protocol.__name__} is not a limited_protocol class")
    return len(registry)


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) reaches only this machine. ``""`` and ``0.0.0.0``
    mean every interface: not loopback. A name counts when every address it resolves to is loopback."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if not name:
        return False
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(host: str, key: object, what: str, how: str = "pass api_key=") -> None:
    """Raise ValueError when ``host`` is not loopback and ``key`` is empty: off loopback, anyone who
    can reach the port would be served. ``what`` names the server, ``how`` says how to give a key."""
    if key is None or (isinstance(key, str) and not key):
        if not is_loopback(host):
            raise ValueError(
                f"{what} would listen on {host!r}, which is not a loopback address, without a key; "
                f"{how} (or bind 127.0.0.1)"
            )
