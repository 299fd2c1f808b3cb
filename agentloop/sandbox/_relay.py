"""The host half of the loopback bridge: one Unix socket per lent port, each connection relayed to
the host's ``127.0.0.1:port``. The sandbox half (``_launcher.py``) listens on ``127.0.0.1:port`` in
the sandbox's own network namespace and connects to the socket, which bubblewrap lends at
``/run/agentloop/relay/<port>.sock``.

Why a relay: ``--unshare-net`` leaves the sandbox with a loopback of its own and nothing else, so
the rollout's proxy on the host's loopback is out of reach. Sharing the host's network would also
open every other host service (the store, Ray, the proxy's admin routes) and the internet. A Unix
socket bound into the mount namespace is one door to one port.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
from anyio.abc import ByteStream, SocketStream

from agentloop.logging import get_logger

log = get_logger("agentloop.sandbox")

__all__ = ["relay_ports"]

CONNECT_TIMEOUT_S = 5.0  # the proxy is on this host's loopback: answering takes milliseconds
MAX_CONNECTIONS = 64  # per port and run; a harness keeps a handful open (streaming + keep-alive)


async def _pump(src: ByteStream, dst: ByteStream) -> None:
    try:
        async for chunk in src:
            await dst.send(chunk)
        await dst.send_eof()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


async def _relay_one(client: SocketStream, port: int, slots: anyio.CapacityLimiter) -> None:
    async with client:
        try:
            slots.acquire_nowait()
        except anyio.WouldBlock:
            log.warning("sandbox_relay_full", port=port, max_connections=MAX_CONNECTIONS)
            return
        try:
            try:
                with anyio.fail_after(CONNECT_TIMEOUT_S):
                    upstream = await anyio.connect_tcp("127.0.0.1", port)
            except (OSError, TimeoutError) as exc:
                log.warning("sandbox_relay_connect_failed", port=port, error=str(exc))
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(_pump, client, upstream)
                tg.start_soon(_pump, upstream, client)
        finally:
            slots.release()


@asynccontextmanager
async def relay_ports(directory: Path, ports: tuple[int, ...], uid: int | None) -> AsyncIterator[None]:
    """Serve ``directory/<port>.sock`` for each port while the block runs; ``uid`` (when not None)
    owns the sockets, the only user that may connect (mode 0600)."""
    if not ports:
        yield
        return
    directory.mkdir(mode=0o711)
    if uid is not None:
        os.chown(directory, uid, uid)
    async with AsyncExitStack() as stack:  # listeners close after the task group that serves them
        listeners = []
        for port in ports:
            path = directory / f"{port}.sock"
            listeners.append(
                await stack.enter_async_context(await anyio.create_unix_listener(path, mode=0o600))
            )
            if uid is not None:
                os.chown(path, uid, uid)
        async with anyio.create_task_group() as tg:
            for port, listener in zip(ports, listeners, strict=True):
                slots = anyio.CapacityLimiter(MAX_CONNECTIONS)

                async def handle(
                    client: SocketStream, port: int = port, slots: anyio.CapacityLimiter = slots
                ) -> None:
                    await _relay_one(client, port, slots)

                tg.start_soon(listener.serve, handle)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
