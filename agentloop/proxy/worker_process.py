"""A proxy worker process's entry point: ``python -m agentloop.proxy.worker_process ANSWER_FD``.

``ProxyWorkers`` (agentloop.proxy.workers) starts one such process per worker; each is a whole
``Proxy`` (agentloop.proxy.server) on a port of its own, with a ``RemoteEngine`` that talks to the
engine in the proxy process. This module sits above both, so the proxy that starts workers and the
proxy that a worker runs do not import each other.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import anyio
import structlog

from agentloop.engine.link import RemoteEngine
from agentloop.proxy.server import Proxy
from agentloop.proxy.workers import WorkerSpec
from agentloop.store.sqlite import SQLiteStore

log = structlog.get_logger("agentloop.proxy")


def worker_main(answer_fd: int) -> None:
    """A worker process's entry point: its spec (JSON) on stdin; serves until SIGTERM or until the
    engine link closes; "ready PORT" or "error WHY" goes back on ``answer_fd``."""
    from agentloop.event_loop import run

    spec = WorkerSpec.from_json(sys.stdin.buffer.read())
    with os.fdopen(answer_fd, "wb", buffering=0) as answer:
        try:
            run(_serve, spec, answer)
        except KeyboardInterrupt:
            pass


async def _serve(spec: WorkerSpec, answer: Any) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, spec.tokenizer_dir)
        engine = RemoteEngine(spec.engine_socket, tokenizer, spec.max_context)
        await engine.start()
        store = SQLiteStore(spec.store_path)
        proxy = Proxy(engine, store, spec.host, spec.port, record_sessions=False, **spec.proxy_kwargs)
        await proxy.start()
    except Exception as exc:
        answer.write(f"error {type(exc).__name__}: {exc}".replace("\n", " ")[:2000].encode() + b"\n")
        raise
    answer.write(f"ready {proxy.port}\n".encode())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.closed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if engine.closed.is_set():
        log.warning("proxy worker: the engine link closed; stopping", index=spec.index)
    await proxy.stop()
    await engine.stop()
    await store.close()


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
