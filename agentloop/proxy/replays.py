"""Idempotency keys: a client retry gets the first try's answer instead of being a second sample.

The service (service.py) runs a call that carries a ``request_key`` through ``RequestReplays.run``:
the first request with a key generates and records once; a request with the same key on the same
attempt or session, while the first runs or up to ``RequestReplays.ttl_s`` after, gets the first
one's answer (same id, same tokens) and records nothing. The same key with a different request is a 409.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
import structlog

from agentloop.proxy.generation import Generation
from agentloop.proxy.schemas import ProxyError

log = structlog.get_logger("agentloop.proxy")


@dataclass
class _Replay:
    fingerprint: bytes
    done: anyio.Event
    created: float
    result: Generation | None = None


class RequestReplays:
    """The answers of calls made with an idempotency key, per attempt or session (module docstring).

    Bounded: an answer is kept ``ttl_s`` seconds (a client retries within its own timeout, minutes),
    and at most ``max_ids`` token ids over all answers are kept (oldest dropped first); a retry after
    its answer was dropped is generated and recorded afresh.
    """

    def __init__(
        self, ttl_s: float = 600.0, max_ids: int = 4_000_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.max_ids, self.clock = ttl_s, max_ids, clock
        self._entries: OrderedDict[tuple[str, str], _Replay] = OrderedDict()
        self._ids = 0  # token ids held by finished entries

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.result is not None:
            self._ids -= len(entry.result.prompt_ids) + len(entry.result.token_ids)

    def _sweep(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.created >= cutoff and self._ids <= self.max_ids:
                break
            self._drop(key)

    async def run(
        self, key: tuple[str, str], fingerprint: bytes, make: Callable[[], Awaitable[Generation]]
    ) -> Generation:
        """The answer already given under ``key``, the one being made (awaited), or ``make()``'s."""
        self._sweep()
        while (entry := self._entries.get(key)) is not None:
            if entry.fingerprint != fingerprint:
                raise ProxyError(
                    409,
                    f"the idempotency key {key[1]!r:.80} was used for a different request; "
                    "use a new key for a new request",
                    "conflict_error",
                    code="idempotency_key_reused",
                )
            if entry.result is None:
                await entry.done.wait()  # the first try is still running (bounded by the engine timeout)
            if entry.result is not None:
                log.info("replayed a retried request", key=key[0])
                return entry.result
            # the first try failed and was forgotten: this one runs (unless another waiter already does)
        mine = _Replay(fingerprint, anyio.Event(), self.clock())
        self._entries[key] = mine
        try:
            mine.result = await make()
        except BaseException:
            if self._entries.get(key) is mine:
                del self._entries[key]
            raise
        finally:
            mine.done.set()
        if self._entries.get(key) is mine:
            self._ids += len(mine.result.prompt_ids) + len(mine.result.token_ids)
            self._sweep()
        return mine.result


def _fingerprint(*parts: Any) -> bytes:
    """A digest of what a request asks for (a reused key must come with the same request)."""
    return hashlib.blake2b(orjson.dumps(parts, default=str), digest_size=16).digest()
