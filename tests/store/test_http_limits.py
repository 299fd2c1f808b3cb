"""The store server under hostile clients (issue 16): idle sockets, half a header, a 96 MB header line,
10 of 100 body bytes and floods of unauthenticated sockets cost the attacker a socket for a bounded
time, never the store its memory or a legitimate client its answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from agentloop.errors import InvalidRequestError
from agentloop.http_limits import HttpLimits
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer

KEY = "admin-key-for-tests"
FAST = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5)


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    async with StoreServer(MemoryStore(), admin_key=KEY, limits=FAST) as srv:
        yield srv


async def connect(server: StoreServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before it closed the connection; fails if it is still open after ``seconds``."""
    with anyio.fail_after(seconds):
        return await reader.read()


async def timed_enqueue(url: str, key: str = KEY) -> float:
    """Seconds a legitimate, authenticated enqueue + read takes."""
    start = time.monotonic()
    async with StoreClient(url, api_key=key, timeout=10) as client:
        rollout = await client.enqueue_rollout({"q": "legit"})
        assert (await client.get_rollout(rollout.rollout_id)).input == {"q": "legit"}
    return time.monotonic() - start


def test_defaults_need_no_tuning() -> None:
    server = StoreServer(MemoryStore())
    assert server.limits == HttpLimits()
    assert 0 < server.limits.header_timeout_s <= 30 and 0 < server.limits.body_timeout_s <= 120
    assert 1024 <= server.limits.max_header_bytes <= 64 * 1024 and server.limits.max_connections >= 1024


async def test_idle_socket_and_half_a_header_are_closed_at_the_header_deadline(server: StoreServer) -> None:
    idle_r, idle_w = await connect(server)
    half_r, half_w = await connect(server)
    half_w.write(b"POST /v1/rollouts HTTP/1.1\r\nHost: store\r\nContent-Le")
    assert await closed_within(idle_r, 3) == b""  # nothing was asked: nothing answered
    answer = await closed_within(half_r, 3)
    assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5s" in answer
    for w in (idle_w, half_w):
        w.close()


async def test_a_kept_alive_connection_gets_a_header_deadline_per_request(server: StoreServer) -> None:
    reader, writer = await connect(server)
    writer.write(f"GET /v1/health HTTP/1.1\r\nHost: s\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    with anyio.fail_after(3):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    writer.write(b"GET /v1/health HTTP/1.1\r\nHost: s\r\n")  # the next request stops halfway
    assert (await closed_within(reader, 3)).startswith(b"HTTP/1.1 408")
    writer.close()


async def test_ten_of_a_hundred_body_bytes_are_cut_at_the_body_deadline(server: StoreServer) -> None:
    reader, writer = await connect(server)
    writer.write(
        f"POST /v1/rollouts HTTP/1.1\r\nHost: s\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        + b'{"input": '
    )
    answer = await closed_within(reader, 3)
    assert answer.startswith(b"HTTP/1.1 408") and b"body did not arrive within 0.5s" in answer
    writer.close()
    assert await timed_enqueue(server.url) < 2


async def test_a_header_over_the_limit_is_431(server: StoreServer) -> None:
    reader, writer = await connect(server)
    writer.write(b"GET /v1/health HTTP/1.1\r\nHost: s\r\nX-Big: " + b"a" * 100_000)
    answer = await closed_within(reader, 3)
    assert answer.startswith(b"HTTP/1.1 431") and b"exceed 32768 bytes" in answer
    writer.close()


async def test_a_96_mb_header_line_is_never_buffered() -> None:
    async with StoreServer(MemoryStore(), admin_key=KEY) as server:  # default limits
        reader, writer = await connect(server)
        before = rss_bytes()
        writer.write(b"GET /v1/health HTTP/1.1\r\nHost: s\r\nX-Big: ")
        chunk = b"a" * 2**20  # one buffer sent 96 times: the client holds 1 MB
        sent = 0
        with anyio.fail_after(60):  # the old server read all of it and then waited for the line's end
            try:
                for _ in range(96):
                    writer.write(chunk)
                    await writer.drain()
                    sent += 1
                await reader.read()
            except (ConnectionError, OSError):
                pass  # the server stopped reading and closed: the rest never left this process
        grown = rss_bytes() - before
        assert sent < 96, "the server read the whole 96 MB header line"
        assert grown < 32 * 2**20, f"the store grew by {grown / 2**20:.0f} MB for one header line"
        writer.close()
        assert await timed_enqueue(server.url) < 2


async def test_an_unauthenticated_request_is_answered_401_and_its_connection_closed(
    server: StoreServer,
) -> None:
    reader, writer = await connect(server)
    writer.write(
        b"POST /v1/rollouts HTTP/1.1\r\nHost: s\r\nContent-Length: 100\r\n\r\n"
    )  # no key, and a body that never comes
    answer = await closed_within(reader, 2)
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
    writer.close()


async def test_400_idle_unauthenticated_sockets_leave_an_authenticated_enqueue_under_2s() -> None:
    async with StoreServer(MemoryStore(), admin_key=KEY) as server:  # default limits
        conns = [await connect(server) for _ in range(400)]
        for i, (_, w) in enumerate(conns):
            if i % 2:
                w.write(b"POST /v1/spans HTTP/1.1\r\nHost: s\r\n")  # half a header
        await anyio.sleep(0.2)
        assert await timed_enqueue(server.url) < 2
        for _, w in conns:
            w.close()


async def test_at_the_connection_limit_unproven_sockets_make_room_for_a_client() -> None:
    limits = HttpLimits(max_connections=50)
    async with StoreServer(MemoryStore(), admin_key=KEY, limits=limits) as server:
        conns = [await connect(server) for _ in range(200)]
        await anyio.sleep(0.2)
        assert server.open_connections <= 50
        assert await timed_enqueue(server.url) < 2
        evicted = 0
        for reader, writer in conns:
            with anyio.move_on_after(0.01):
                evicted += await reader.read() == b""
            writer.close()
        assert evicted >= 150


async def test_a_non_loopback_bind_needs_a_key() -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", ""):
        with pytest.raises(InvalidRequestError, match=r"without a key.*admin_key"):
            StoreServer(MemoryStore(), host=host)
    StoreServer(MemoryStore(), host="0.0.0.0", admin_key=KEY)  # with a key: allowed
    StoreServer(MemoryStore(), host="0.0.0.0", runner_keys={"r1": "runner-key"})
    StoreServer(MemoryStore(), host="localhost")
    StoreServer(MemoryStore(), host="::1")
