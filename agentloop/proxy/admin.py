"""Admin routes of a proxy that trains online (``agentloop serve --train``): the weights versions it
promoted, and a rollback to any of them.

``GET /v1/admin/versions`` lists the promoted versions (their scores, which one serves) and the log
of promotions, refusals and rollbacks; ``POST /v1/admin/rollback`` with ``{"version": N}`` loads
version N into the serving engine. Both need the proxy's key when it has one (401 without it); an
unknown version is a 404, a body that is not ``{"version": <int >= 0>}`` a 400.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from agentloop.proxy.app import BearerAuth


class VersionControl(Protocol):
    """What the admin routes drive (``trainer.online.OnlineTrainer``)."""

    def versions(self) -> dict[str, Any]: ...

    async def rollback(self, version: int) -> dict[str, Any]: ...


def _error(status: int, message: str, kind: str) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": kind}})
    return Response(body, status_code=status, media_type="application/json")


def _unauthorized() -> Response:
    return _error(
        401, "missing or wrong bearer token (Authorization: Bearer <api_key>)", "authentication_error"
    )


def add_admin_routes(app: Starlette, control: VersionControl, api_key: SecretStr | str | None) -> None:
    """Add the two routes to the proxy's Starlette ``app`` (before it starts serving)."""
    auth = BearerAuth(api_key)

    async def versions(request: Request) -> Response:
        if not auth.allows(request):
            return _unauthorized()
        return Response(orjson.dumps(control.versions()), media_type="application/json")

    async def rollback(request: Request) -> Response:
        if not auth.allows(request):
            return _unauthorized()
        raw = b""
        async for chunk in request.stream():  # a small body: stop reading past 4 KiB
            raw += chunk
            if len(raw) > 4096:
                return _error(413, "the body must be under 4 KiB", "invalid_request_error")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        version = body.get("version") if isinstance(body, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return _error(
                400,
                f'expected a JSON body {{"version": <int >= 0>}}, got {raw[:80]!r}',
                "invalid_request_error",
            )
        try:
            done = await control.rollback(version)
        except KeyError:
            known = [v["version"] for v in control.versions()["versions"]]
            return _error(
                404, f"no promoted version {version}; promoted versions: {known}", "not_found_error"
            )
        return Response(orjson.dumps(done), media_type="application/json")

    app.add_route("/v1/admin/versions", versions, methods=["GET"])
    app.add_route("/v1/admin/rollback", rollback, methods=["POST"])
