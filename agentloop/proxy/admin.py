"""Admin routes of a proxy that trains online (``agentloop serve --train``): the weights versions it
promoted, and a rollback to any of them.

``GET /v1/admin/versions`` lists the promoted versions (their scores, which one serves) and the log
of promotions, refusals and rollbacks; ``POST /v1/admin/rollback`` with ``{"version": N}`` loads
version N into the serving engine. Both need the admin key (``agentloop serve --admin-key-file``;
401 without it; an app key is not enough), and without an admin key they are off (403). A POST must be
``Content-Type: application/json`` (415), and on a loopback server a web page is refused (403: a
foreign ``Host``, another ``Origin``; see agentloop/proxy/access.py). An unknown version is a 404,
a body that is not ``{"version": <int >= 0>}`` a 400.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from agentloop.proxy.access import AppKeys, check_browser, check_json
from agentloop.proxy.schemas import ProxyError


class VersionControl(Protocol):
    """What the admin routes drive (``trainer.online.OnlineTrainer``)."""

    def versions(self) -> dict[str, Any]: ...

    async def rollback(self, version: int) -> dict[str, Any]: ...


def _error(status: int, message: str, kind: str) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": kind}})
    return Response(body, status_code=status, media_type="application/json")


def add_admin_routes(
    app: Starlette,
    control: VersionControl,
    admin_key: SecretStr | str | None,
    *,
    bound_host: str | None = None,
) -> None:
    """Add the two routes to the proxy's Starlette ``app`` (before it starts serving). ``admin_key``
    None: the routes answer 403 (off). ``bound_host``: the proxy's bind address (on loopback, requests
    naming another host or from another origin are refused; None: not checked)."""
    keys = AppKeys([], admin_key)

    def refused(request: Request) -> Response | None:
        """The answer to a request the admin routes refuse; None when it may go on."""
        try:
            check_browser(request, bound_host)
            if not keys.admin_on:
                raise ProxyError(
                    403,
                    "the admin routes are off: this server has no admin key (start agentloop serve with "
                    "--admin-key-file PATH or $AGENTLOOP_ADMIN_KEY)",
                    "permission_error",
                    code="admin_off",
                )
            if not keys.is_admin(request):
                raise ProxyError(
                    401,
                    "missing or wrong admin key (Authorization: Bearer <admin_key>; an app key is not enough)",
                    "authentication_error",
                    code="invalid_api_key",
                )
            check_json(request)
        except ProxyError as exc:
            return Response(orjson.dumps(exc.body()), status_code=exc.status, media_type="application/json")
        return None

    async def versions(request: Request) -> Response:
        if (answer := refused(request)) is not None:
            return answer
        return Response(orjson.dumps(control.versions()), media_type="application/json")

    async def rollback(request: Request) -> Response:
        if (answer := refused(request)) is not None:
            return answer
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
