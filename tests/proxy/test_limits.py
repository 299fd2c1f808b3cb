"""The proxy's HTTP server under hostile clients (issue 16): idle sockets, half a header, a 96 MB
header line, 10 of 100 body bytes, and floods of unauthenticated sockets while a real client still
gets its answer. Raw sockets play the attacker; the real openai client plays the agent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import psutil
import pytest

from agentloop.http_limits import HttpLimits, check_bind, is_loopback
from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KEY = "k-test-1"
AUTH = {"authorization": f"Bearer {KEY}"}
MB = 1 << 20


@asynccontextmanager
async def raw(proxy: Proxy) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw TCP connection to the proxy (the attacker's side)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:  # reset by the server
            pass


async def read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """What the server sends before it closes the connection, and how long it took."""
    start, data = time.monotonic(), b""
    with anyio.fail_after(limit_s):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionError:  # reset: the server closed with our bytes unread
            pass
    return data, time.monotonic() - start


async def test_idle_and_half_sent_headers_are_cut_at_the_header_deadline(tokenizer: Any) -> None:
    limits = HttpLimits(header_timeout_s=0.5)
    async with running_proxy(EchoEngine(tokenizer), limits=limits) as proxy:
        async with raw(proxy) as (idle, _), raw(proxy) as (half, w):
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
            (silent, t_idle), (answer, t_half) = await asyncio.gather(
                read_until_closed(idle, 5), read_until_closed(half, 5)
            )
        assert silent == b"" and 0.4 < t_idle < 3  # nothing sent: closed without an answer
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5s" in answer
        assert 0.4 < t_half < 3
        # a keep-alive connection's next request gets its own deadline, from its first byte
        async with raw(proxy) as (r, w):
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await r.readuntil(b'{"status":"ok"}')).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.8)  # longer than the header deadline, shorter than keep-alive (30 s)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await r.readuntil(b'{"status":"ok"}')).startswith(b"HTTP/1.1 200")
            w.write(b"GET /health HTTP/1.1\r\nHo")
            answer, took = await read_until_closed(r, 5)
            assert answer.startswith(b"HTTP/1.1 408") and 0.4 < took < 3


@pytest.mark.parametrize("key", [None, KEY])
async def test_ten_of_a_hundred_body_bytes_are_cut_at_the_body_deadline(
    tokenizer: Any, key: str | None
) -> None:
    limits = HttpLimits(body_timeout_s=0.5)
    async with running_proxy(EchoEngine(tokenizer), api_key=key, limits=limits) as proxy:
        async with raw(proxy) as (r, w):
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n" + b'{"messages"')  # fmt: skip
            answer, took = await read_until_closed(r, 5)
        # no key: the app waits for the body and the deadline answers 408; with a key the request is
        # refused (401) before its body is read, and the connection closes with the answer
        if key is None:
            assert answer.startswith(b"HTTP/1.1 408") and 0.4 < took < 3, (answer[:80], took)
        else:
            assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
            assert took < 0.4
        async with httpx.AsyncClient(timeout=5, headers=AUTH) as http:  # the server is fine
            assert (await http.get(f"{proxy.url}/health")).status_code == 200


class RssPeak:
    """The highest resident memory of this process while it runs (sampled every 5 ms in a thread)."""

    def __init__(self) -> None:
        self.proc, self.base, self.peak = psutil.Process(), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB


async def test_a_96_mb_header_line_is_refused_and_memory_stays_bounded(tokenizer: Any) -> None:
    async with running_proxy(EchoEngine(tokenizer), api_key=KEY) as proxy:  # default limits
        chunk = b"a" * MB
        sent = 0
        with RssPeak() as rss:
            async with raw(proxy) as (r, w):
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
                with anyio.fail_after(60):
                    try:
                        for _ in range(96):
                            w.write(chunk)
                            await w.drain()
                            sent += 1
                    except ConnectionError:  # the server closed the connection
                        pass
                    answer, _ = await read_until_closed(r, 10)
        assert sent < 96, "the server read the whole 96 MB header line"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:80]
        assert rss.growth_mb < 24, f"RSS grew {rss.growth_mb:.0f} MB during the header attack"
        async with httpx.AsyncClient(timeout=5, headers=AUTH) as http:
            assert (await http.get(f"{proxy.url}/health")).status_code == 200
        big = {"x-big": "a" * (HttpLimits().max_header_bytes + 1)}
        async with httpx.AsyncClient(timeout=5, headers=AUTH) as http:
            assert (await http.get(f"{proxy.url}/health", headers=big)).status_code == 431


async def _answer_time(proxy: Proxy, store: Any) -> float:
    """Seconds the real openai client takes for one authenticated chat completion (a fresh connection)."""
    import openai

    url = attempt_url(proxy, await new_attempt(store))
    start = time.monotonic()
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=10) as client:
        resp = await client.chat.completions.create(model="m", **CHAT)  # type: ignore[call-overload]
    assert resp.choices[0].message.content
    return time.monotonic() - start


async def test_400_idle_unauthenticated_sockets_do_not_delay_a_real_client(tokenizer: Any) -> None:
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer), store, api_key=KEY) as proxy:  # default limits
        with RssPeak() as rss:
            conns = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(400)]
            for i, (_, w) in enumerate(conns[:100]):  # a quarter of them sent half a header...
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-%d: " % i + b"a" * 30_000)
            for _, w in conns[100:150]:  # ...some a request without the key (401, then closed)
                w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.2)
            took = await _answer_time(proxy, store)
        assert took < 2, f"a real client waited {took:.2f}s behind 400 idle sockets"
        assert proxy.open_connections <= 351  # the refused ones are gone (+1: the real client)
        assert rss.growth_mb < 64, f"RSS grew {rss.growth_mb:.0f} MB for 400 sockets"  # both ends' buffers
        for _, w in conns:
            w.close()


async def test_when_every_connection_is_answering_a_new_one_gets_503(tokenizer: Any) -> None:
    store = MemoryStore()
    engine = EchoEngine(tokenizer, delay_s=3.0)
    async with running_proxy(engine, store, limits=HttpLimits(max_connections=2)) as proxy:
        busy = [asyncio.ensure_future(_answer_time(proxy, store)) for _ in range(2)]
        with anyio.fail_after(10):  # both being answered (a fixed sleep raced a loaded machine)
            while len(engine.calls) < 2:
                await asyncio.sleep(0.01)
        async with raw(proxy) as (r, _):
            answer, _ = await read_until_closed(r, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer
        assert all(t < 8 for t in await asyncio.gather(*busy))  # those being answered were kept


async def test_at_the_connection_limit_idle_sockets_make_room_for_real_clients(tokenizer: Any) -> None:
    store = MemoryStore()
    limits = HttpLimits(max_connections=32)
    engine = EchoEngine(tokenizer, delay_s=1.0)
    async with running_proxy(engine, store, api_key=KEY, limits=limits) as proxy:
        # a request in flight is never evicted, however many sockets arrive after it
        in_flight = asyncio.ensure_future(_answer_time(proxy, store))
        await asyncio.sleep(0.3)
        conns = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(100)]
        await asyncio.sleep(0.2)
        assert proxy.open_connections <= 32
        engine.delay_s = 0.0
        assert await _answer_time(proxy, store) < 2  # the oldest idle socket made room
        assert await in_flight < 3
        closed = 0
        for r, w in conns:  # most of the flood was closed by the server
            try:
                closed += await asyncio.wait_for(r.read(1), 0.05) == b""
            except (TimeoutError, ConnectionResetError):
                closed += 0
            w.close()
        assert closed >= 100 - 32


def test_limits_have_bounded_defaults_and_check_their_arguments() -> None:
    d = HttpLimits()
    assert d.max_connections <= 8192 and d.header_timeout_s <= 30 and d.body_timeout_s <= 60
    assert d.max_header_bytes <= 64 * 1024
    for kwargs in ({"max_connections": 0}, {"max_header_bytes": 10}, {"header_timeout_s": 0}):
        with pytest.raises(ValueError):
            HttpLimits(**kwargs)  # type: ignore[arg-type]


def test_a_non_loopback_bind_needs_a_key(tokenizer: Any) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.3.4.5") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
    assert not is_loopback("10.1.2.3") and not is_loopback("no-such-host.invalid")
    engine = EchoEngine(tokenizer)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ValueError, match="not a loopback address, without a key"):
            Proxy(engine, MemoryStore(), host=host)
        with pytest.raises(ValueError, match="not a loopback address"):
            Proxy(engine, MemoryStore(), host=host, api_key="")
        assert Proxy(engine, MemoryStore(), host=host, api_key=KEY).api_key is not None
    Proxy(engine, MemoryStore(), host="127.0.0.1")  # loopback: a key is optional
    with pytest.raises(ValueError, match="the store"):
        check_bind("0.0.0.0", None, "the store")


@pytest.mark.parametrize("piece", [1, 3, 7, 4096])
async def test_the_header_limit_is_exact_however_the_bytes_are_split(tokenizer: Any, piece: int) -> None:
    limits = HttpLimits(max_header_bytes=1024)
    async with running_proxy(EchoEngine(tokenizer), limits=limits) as proxy:
        for extra, status in ((0, b"200"), (1, b"431")):
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
            request = head + b"a" * (1024 - len(head) - 4 + extra) + b"\r\n\r\n"
            assert len(request) == 1024 + extra
            async with raw(proxy) as (r, w):
                for i in range(0, len(request), piece):
                    w.write(request[i : i + piece])
                    await w.drain()
                    if piece < 10 and i % 64 == 0:
                        await asyncio.sleep(0)  # let the server read in small pieces
                answer = await asyncio.wait_for(r.read(200), 5)
            assert answer.startswith(b"HTTP/1.1 " + status), (piece, extra, answer[:60])
