"""A burst of generate calls streamed back as each finishes (``generate_many`` of TorchEngine and of
EngineReplica): each answer or error labelled with its request id, and the rest aborted when the
consumer stops reading."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Sequence

from agentloop.engine.base import TokenOutput

Answer = tuple[str, TokenOutput | Exception]


async def labelled(request_id: str, result: Awaitable[TokenOutput]) -> Answer:
    """``(request_id, output)``, or ``(request_id, error)`` when awaiting ``result`` raised."""
    try:
        return request_id, await result
    except Exception as exc:
        return request_id, exc


async def as_finished(answers: Sequence[Awaitable[Answer]]) -> AsyncGenerator[Answer, None]:
    """Yield ``answers`` in the order they finish; closing the iterator cancels the ones still running
    (a cancelled generate call aborts its request in the engine)."""
    tasks = [asyncio.ensure_future(a) for a in answers]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for t in tasks:
            t.cancel()
