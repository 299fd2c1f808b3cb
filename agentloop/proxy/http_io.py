"""The proxy handlers' request and response helpers: the idempotency key, JSON, SSE and error responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from agentloop.proxy.schemas import JSONDict, ProxyError

RETURN_IDS_HEADER = "x-return-token-ids"


def request_key(request: Request) -> str | None:
    """The client's idempotency key: ``Idempotency-Key`` or ``X-Request-Id`` (at most 256 characters)."""
    key = request.headers.get("idempotency-key") or request.headers.get("x-request-id")
    return key[:256] if key else None


def want_ids(request: Request, body: Any) -> bool:
    flag = request.headers.get(RETURN_IDS_HEADER, "").lower() in ("1", "true", "yes")
    return flag or bool(body.get("return_token_ids"))


ErrorShape = Callable[[ProxyError], JSONDict]  # a protocol's error body


def error_response(
    exc: ProxyError, headers: dict[str, str] | None = None, shape: ErrorShape = ProxyError.body
) -> Response:
    if exc.status == 401:  # then the connection closes: a client without the key holds no socket
        headers = {**(headers or {}), "Connection": "close"}
    return Response(
        orjson.dumps(shape(exc)), status_code=exc.status, media_type="application/json", headers=headers
    )


def json_response(body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, media_type="application/json", headers=headers)


def sse_response(chunks: Iterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:  # async: a sync iterator would cost a thread hop per chunk
        for chunk in chunks:
            yield chunk

    hdrs = {"Cache-Control": "no-cache", **headers}
    return StreamingResponse(body(), media_type="text/event-stream", headers=hdrs)
