"""StoreClient: the Store protocol over HTTP, against a StoreServer (agentloop.store.server).

It raises the same exceptions as the in-process stores: each error ``type`` the server answers maps to
one class (the table in agentloop/store/server.py). Requests go through a lean keep-alive pool
(agentloop/store/_wire.py) that retries connection refusals within each request's timeout, so runners
ride out a store restart; a request that may have been applied is resent only when it is idempotent.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal
from urllib.parse import quote, urlencode

import orjson
from pydantic import TypeAdapter

from agentloop.errors import (
    AgentLoopError,
    InvalidRequestError,
    InvalidTransitionError,
    NotFoundError,
    StaleAttemptError,
    StoreUnavailableError,
)
from agentloop.resources import Resources, ResourcesLike
from agentloop.store import state
from agentloop.store._keys import Key, plain_key
from agentloop.store._wire import WireError, WirePool
from agentloop.store.state import (
    parse_error,
    parse_ids,
    parse_limit,
    parse_resources,
    parse_span,
    parse_statuses,
    parse_version,
)
from agentloop.types import (
    JSON,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ErrorInfo,
    Rollout,
    RolloutMode,
    Span,
)

MAX_WAIT_S = 30.0  # longest server-side wait per request; the client loops for longer waits
ROLLOUT_LIST = TypeAdapter(list[Rollout])
ATTEMPT_LIST = TypeAdapter(list[Attempt])
SPAN_LIST = TypeAdapter(list[Span])
ROLLOUT_ATTEMPT = TypeAdapter(tuple[Rollout, Attempt])
_ERROR_CLASSES: dict[str, type[AgentLoopError]] = {
    "invalid_json": InvalidRequestError,
    "invalid_request": InvalidRequestError,
    "payload_too_large": InvalidRequestError,
    "not_found": NotFoundError,
    "stale_attempt": StaleAttemptError,
    "invalid_transition": InvalidTransitionError,
    "unauthorized": StoreUnavailableError,
    "forbidden": InvalidRequestError,
}
_IDEMPOTENT = frozenset({"/v1/wait", "/v1/rollouts/list", "/v1/check_timeouts"})  # POSTs safe to resend


def _q(part: str) -> str:
    return quote(part, safe="")


class StoreClient:
    """The Store protocol over HTTP; raises the same exceptions as the in-process stores."""

    def __init__(
        self, url: str, api_key: Key | None = None, timeout: float = 30.0, max_connections: int = 256
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"url must start with http:// or https://, got {url!r:.80}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise InvalidRequestError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise InvalidRequestError(f"timeout must be a number of seconds > 0, got {timeout!r:.80}")
        self.url = url.rstrip("/")
        key = plain_key(api_key, "api_key")
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self._timeout = float(timeout)
        # a lean keep-alive pool (see _wire): httpx's per-request overhead was most of a store call's cost;
        # connection refusals (a store restarting) are retried within each request's timeout
        self._pool = WirePool(self.url, max_connections, headers)

    async def _request(
        self, method: str, path: str, json: Any = None, params: Any = None, timeout: float | None = None
    ) -> bytes:
        content = orjson.dumps(json) if json is not None else None
        if params:
            path = f"{path}?{urlencode(params)}"
        try:
            status, data = await self._pool.request(
                method,
                path,
                content,
                timeout or self._timeout,
                idempotent=method == "GET" or path in _IDEMPOTENT,
            )
        except WireError as exc:
            raise StoreUnavailableError(f"store at {self.url} unreachable ({exc})") from None
        if status < 400:
            return data
        try:
            err = orjson.loads(data)["error"]
            message, kind = str(err["message"]), str(err["type"])
        except Exception:
            message, kind = data[:300].decode("utf-8", "replace"), "unknown"
        cls = _ERROR_CLASSES.get(kind)
        if status == 401:
            raise StoreUnavailableError(
                f"store at {self.url} refused the request (401): {message}; pass its api_key"
            )
        if cls is None or status >= 500:
            raise StoreUnavailableError(f"store at {self.url} answered {status}: {message}")
        raise cls(message)

    async def enqueue_rollout(
        self,
        input: JSON,
        mode: RolloutMode = "train",
        config: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        checked = state.new_rollout(input, mode, config, metadata, 0.0)  # same errors as the local stores
        body = {
            "input": input,
            "mode": mode,
            "config": checked.config.model_dump(mode="json"),
            "metadata": metadata,
        }
        return Rollout.model_validate_json(await self._request("POST", "/v1/rollouts", body))

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        if worker_id is not None:
            state.require_id("worker_id", worker_id)
        data = await self._request("POST", "/v1/dequeue", {"worker_id": worker_id})
        return None if data == b"null" else AttemptedRollout.model_validate_json(data)

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | str | None = None,
        error: ErrorInfo | None = None,
        heartbeat: bool = False,
    ) -> Attempt:
        rid, aid = (
            _q(state.require_id("rollout_id", rollout_id)),
            _q(state.require_id("attempt_id", attempt_id)),
        )
        parsed, err = state.parse_attempt_status(status), parse_error(error)
        body = {"status": parsed, "error": err.model_dump() if err else None, "heartbeat": bool(heartbeat)}
        return Attempt.model_validate_json(
            await self._request("POST", f"/v1/rollouts/{rid}/attempts/{aid}", body)
        )

    async def add_span(self, span: Span) -> Span:
        span = parse_span(span)
        return Span.model_validate_json(
            await self._request("POST", "/v1/spans", span.model_dump(mode="json"))
        )

    async def query_spans(
        self, rollout_id: str, attempt_id: str | Literal["latest"] = "latest"
    ) -> list[Span]:
        rid, aid = _q(state.require_id("rollout_id", rollout_id)), state.require_id("attempt_id", attempt_id)
        data = await self._request("GET", f"/v1/rollouts/{rid}/spans", params={"attempt_id": aid})
        return SPAN_LIST.validate_json(data)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        rid = _q(state.require_id("rollout_id", rollout_id))
        return Rollout.model_validate_json(await self._request("GET", f"/v1/rollouts/{rid}"))

    async def get_attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        rid, aid = (
            _q(state.require_id("rollout_id", rollout_id)),
            _q(state.require_id("attempt_id", attempt_id)),
        )
        return Attempt.model_validate_json(await self._request("GET", f"/v1/rollouts/{rid}/attempts/{aid}"))

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> tuple[Rollout, Attempt]:
        rid, aid = (
            _q(state.require_id("rollout_id", rollout_id)),
            _q(state.require_id("attempt_id", attempt_id)),
        )
        data = await self._request("GET", f"/v1/rollouts/{rid}/attempts/{aid}/with_rollout")
        return ROLLOUT_ATTEMPT.validate_json(data)

    async def list_attempts(self, rollout_id: str) -> list[Attempt]:
        rid = _q(state.require_id("rollout_id", rollout_id))
        return ATTEMPT_LIST.validate_json(await self._request("GET", f"/v1/rollouts/{rid}/attempts"))

    async def list_rollouts(self, status: list[str] | None = None, limit: int | None = None) -> list[Rollout]:
        wanted, limit = parse_statuses(status), parse_limit(limit)
        body = {"status": sorted(wanted) if wanted is not None else None, "limit": limit}
        return ROLLOUT_LIST.validate_json(await self._request("POST", "/v1/rollouts/list", body))

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        rid = _q(state.require_id("rollout_id", rollout_id))
        return Rollout.model_validate_json(await self._request("POST", f"/v1/rollouts/{rid}/cancel"))

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float) -> list[Rollout]:
        """Server-side waits of at most MAX_WAIT_S each, repeated until ``timeout`` passed."""
        ids, timeout = parse_ids(rollout_ids), state.require_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            step = min(max(deadline - loop.time(), 0.0), MAX_WAIT_S)
            data = await self._request(
                "POST", "/v1/wait", {"rollout_ids": ids, "timeout": step}, timeout=step + self._timeout
            )
            done = ROLLOUT_LIST.validate_json(data)
            if len(done) == len(ids) or loop.time() >= deadline or math.isclose(step, 0.0):
                return done

    async def check_timeouts(self) -> list[Attempt]:
        return ATTEMPT_LIST.validate_json(await self._request("POST", "/v1/check_timeouts", {}))

    async def add_resources(self, resources: ResourcesLike) -> int:
        parsed = parse_resources(resources)
        data = await self._request("POST", "/v1/resources", parsed.model_dump(mode="json"))
        return int(TypeAdapter(dict[str, int]).validate_json(data)["version"])

    async def get_latest_resources(self) -> Resources | None:
        data = await self._request("GET", "/v1/resources/latest")
        return None if data == b"null" else Resources.model_validate_json(data)

    async def get_resources(self, version: int) -> Resources:
        return Resources.model_validate_json(
            await self._request("GET", f"/v1/resources/{parse_version(version)}")
        )

    async def close(self) -> None:
        await self._pool.close()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
