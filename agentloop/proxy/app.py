"""The proxy's ASGI app (Starlette): OpenAI routes per rollout attempt (``/rollout/{rid}/attempt/{aid}/v1/...``) and
for app sessions (``/v1/...``, session id in the ``X-Session-Id`` header).

Routes (each under both prefixes): ``POST chat/completions``, ``POST completions``, ``GET models``,
``POST messages`` and ``POST messages/count_tokens`` (the Anthropic Messages API, anthropic.py) and
``POST responses`` (the OpenAI Responses API, openai_responses.py and responses_output.py); both
become chat requests and take the chat path (service.py). A session request without ``X-Session-Id``
but with Codex CLI's ``session-id`` header is recorded under that id.
Sessions only: ``POST /v1/sessions/{id}/reward`` (``{"value": 1.0}`` or ``{"reward": 1.0}``, optional
``"name"``), ``GET /v1/sessions/{id}`` (its calls with token ids, and rewards), ``GET /v1/sessions``
(every session held: id, number of calls, rewards). ``GET /health``.

Every error answers with an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
(``messages``: Anthropic's ``{"type": "error", "error": {"type", "message"}}``):
400 bad input (``context_length_exceeded`` included), 401 missing/wrong bearer token (and the
connection is closed: a client without the key holds no socket), 404 unknown
rollout/attempt/session/route (``model_not_found``: a session request naming a model not served),
403 a web page's request on the app routes (a foreign ``Host`` on loopback, another ``Origin``),
408 body not sent in time, 409 stale attempt, 413 body too large, 415 a POST on the app routes that
is not ``application/json``, 503 engine or store failure (or engine timeout). Who may use the app
routes (app keys, each owning its sessions; the admin key) is agentloop/proxy/access.py.
An unexpected exception is logged and answered 503, never 500. The HTTP server in front of the app
(agentloop/http_limits.py) answers in plain text 408 for headers or a body not sent in time, 431 for
headers over the size limit, and 503 when every connection slot is answering a request.

The handlers are ``Routes`` (routes.py); what they share to read and answer a request is http_io.py;
the per-attempt routes' key check is bearer_auth.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from agentloop.proxy import anthropic
from agentloop.proxy.access import AppKeys
from agentloop.proxy.bearer_auth import BearerAuth
from agentloop.proxy.http_io import error_response, json_response
from agentloop.proxy.routes import Routes
from agentloop.proxy.schemas import ProxyError
from agentloop.proxy.service import ProxyService

log = structlog.get_logger("agentloop.proxy")

BODY_TIMEOUT_S = 30.0
_STATUS_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def build_app(
    service: ProxyService,
    *,
    api_key: SecretStr | str | None,
    max_body_bytes: int,
    body_timeout_s: float = BODY_TIMEOUT_S,
    app_keys: Sequence[SecretStr | str] | None = None,
    admin_key: SecretStr | str | None = None,
    bound_host: str | None = None,
) -> Starlette:
    """The proxy's ASGI app around ``service``. ``api_key``: the per-attempt routes' key, and the one
    app key when ``app_keys`` is None; ``app_keys`` and ``admin_key``: who may use the session routes
    (agentloop/proxy/access.py); ``bound_host``: the address the server listens on (on loopback, the
    session routes refuse foreign ``Host`` names and other origins)."""
    # Starlette, not FastAPI: the routes below are plain Starlette routes, and FastAPI's own middleware
    # (telemetry, body limit, exit stack) cost event-loop CPU on every request for nothing here
    app = Starlette()
    routes = Routes(
        service,
        auth=BearerAuth(api_key),  # the per-attempt routes
        access=AppKeys([api_key] if app_keys is None else app_keys, admin_key),  # the session routes
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        bound_host=bound_host,
    )
    _add_openai_routes(app, routes)
    _add_session_routes(app, routes)
    _add_error_handlers(app)
    return app


def _add_openai_routes(app: Starlette, routes: Routes) -> None:
    """The model routes, under the per-attempt prefix and under ``/v1`` (app sessions)."""
    # Plain routes (request in, response out): a dependency solver would cost
    # more per request than the proxy's own work, and the bodies are validated by hand anyway.
    guarded, r = routes.guarded, routes
    for prefix, session in (("/rollout/{rollout_id}/attempt/{attempt_id}/v1", False), ("/v1", True)):
        app.add_route(f"{prefix}/chat/completions", guarded(r.chat, session), methods=["POST"])
        app.add_route(f"{prefix}/completions", guarded(r.completions, session), methods=["POST"])
        app.add_route(f"{prefix}/models", guarded(r.models, session), methods=["GET"])
        app.add_route(
            f"{prefix}/messages", guarded(r.messages, session, anthropic.error_body), methods=["POST"]
        )
        app.add_route(
            f"{prefix}/messages/count_tokens",
            guarded(r.count_tokens, session, anthropic.error_body),
            methods=["POST"],
        )
        app.add_route(f"{prefix}/responses", guarded(r.responses_api, session), methods=["POST"])


def _add_session_routes(app: Starlette, routes: Routes) -> None:
    """The app sessions' own routes (rewards, records), and ``/health``."""
    app.add_route("/v1/sessions/{session_id}/reward", routes.post_reward, methods=["POST"])
    app.add_route("/v1/sessions/{session_id}", routes.get_session, methods=["GET"])
    app.add_route("/v1/sessions", routes.list_sessions, methods=["GET"])
    app.add_route("/health", _health, methods=["GET"])


def _add_error_handlers(app: Starlette) -> None:
    """Starlette's own errors (unknown route, wrong method) and anything unexpected: OpenAI-style bodies."""

    async def _http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = _STATUS_TYPES.get(exc.status_code, "invalid_request_error")
        return error_response(
            ProxyError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind)
        )

    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected proxy error", path=request.url.path)
        return error_response(
            ProxyError(503, f"internal proxy error: {type(exc).__name__}", "service_unavailable")
        )

    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _health(request: Request) -> Response:
    return json_response(b'{"status":"ok"}')
