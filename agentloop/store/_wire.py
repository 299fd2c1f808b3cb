"""A lean HTTP/1.1 keep-alive client for StoreClient: one small request, one small JSON answer.

httpx costs ~1 ms of CPU per request (pool bookkeeping, header models, event hooks); the store's
requests are tiny and all alike, so this pool writes them by hand and parses answers with
httptools (the parser uvicorn uses). Supports http and https, Content-Length and chunked bodies.

Retries (all within the request's own deadline, so a call never outlives its timeout):

- connection refused before anything was sent: always safe, retried with backoff (this is what
  lets runners ride out a store restart); kept-alive connections the server closed meanwhile are
  dropped before use, never written to;
- a failure after the request was sent (the store may have applied it, then died) is retried only
  for ``idempotent`` requests; others raise, so a span or a status is never written twice.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)


class WireError(Exception):
    """The request could not be completed (connection failed, closed, timed out, garbled answer)."""


@dataclass
class _Answer:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    done: bool = False
    keep_alive: bool = True

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class WirePool:
    """Keep-alive connections to one origin, at most ``max_connections`` open at once."""

    def __init__(self, url: str, max_connections: int, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = parts.netloc.rsplit("@", 1)[-1]
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head_tail = f"Host: {host_header}\r\n{extra}".encode("latin-1")
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def _open(self) -> _Conn:
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=self._ssl, limit=2**22, server_hostname=self.host if self._ssl else None
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(reader, writer)

    async def request(
        self, method: str, path: str, body: bytes | None, timeout: float, idempotent: bool
    ) -> tuple[int, bytes]:
        """Send one request; (status, body). Raises WireError once the deadline passed or on a hard failure."""
        if self._closed:
            raise WireError("the client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        head = self._head(method, path, body)
        tries = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    async with self._slots:
                        return await self._exchange(head, body)
            except TimeoutError:
                raise WireError(f"no answer within {timeout}s") from None
            except _Retry as exc:
                if not (exc.safe or idempotent) or loop.time() >= deadline:
                    raise WireError(f"{type(exc.cause).__name__}: {exc.cause}") from exc.cause
                delay = _BACKOFF_S[min(tries, len(_BACKOFF_S) - 1)]
                tries += 1
                if loop.time() + delay >= deadline:
                    raise WireError(f"{exc.cause} (gave up after {tries} tries in {timeout}s)") from exc.cause
                await asyncio.sleep(delay)

    def _head(self, method: str, path: str, body: bytes | None) -> bytes:
        length = (
            f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n" if body is not None else ""
        )
        return (
            f"{method} {self.base_path}{path} HTTP/1.1\r\n{length}".encode("latin-1")
            + self._head_tail
            + b"\r\n"
        )

    def _idle_conn(self) -> _Conn | None:
        """A kept-alive connection the server has not closed meanwhile (closed ones are dropped)."""
        while self._idle:
            conn = self._idle.pop()
            if not (conn.reader.at_eof() or conn.writer.is_closing()):
                return conn
            conn.close()
        return None

    async def _exchange(self, head: bytes, body: bytes | None) -> tuple[int, bytes]:
        conn = self._idle_conn()
        if conn is None:
            try:
                conn = await self._open()
            except OSError as exc:  # refused, unreachable: nothing was sent
                raise _Retry(exc, safe=True) from None
        ok = False
        try:
            conn.writer.write(head + body if body is not None else head)
            answer = _Answer()
            parser = httptools.HttpResponseParser(answer)
            while not answer.done:
                data = await conn.reader.read(65536)
                if not data:
                    raise ConnectionResetError("the server closed the connection before answering")
                parser.feed_data(data)
            # (httptools' should_keep_alive() reads False once the message completed; HTTP/1.1 keeps alive)
            answer.keep_alive = answer.headers.get(b"connection", b"").lower() != b"close"
            answer.status = parser.get_status_code()
            ok = True
        except OSError as exc:
            # the request may have reached the store (which then died): resent only when idempotent
            raise _Retry(exc, safe=False) from None
        except httptools.HttpParserError as exc:
            raise WireError(f"garbled HTTP answer: {exc}") from None
        finally:
            if ok and answer.keep_alive and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
        return answer.status, b"".join(answer.body)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Retry(Exception):
    def __init__(self, cause: BaseException, safe: bool) -> None:
        super().__init__(str(cause))
        self.cause, self.safe = cause, safe
