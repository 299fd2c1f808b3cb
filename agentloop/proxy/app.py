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
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio
import orjson
import structlog
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from agentloop.proxy import anthropic, anthropic_output, openai_responses, responses, responses_output
from agentloop.proxy.access import AppKeys, Caller, check_browser, check_json
from agentloop.proxy.attempt_keys import attempt_key
from agentloop.proxy.disconnect import ClientWatch
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JSONDict,
    ProxyError,
    RewardRequest,
    bad_request,
    parse_model,
)
from agentloop.proxy.service import ProxyService, Target
from agentloop.proxy.sessions import new_session_id, session_not_found, valid_session_id
from agentloop.types import Reward

log = structlog.get_logger("agentloop.proxy")

SESSION_HEADER = "x-session-id"
CODEX_SESSION_HEADER = "session-id"
RETURN_IDS_HEADER = "x-return-token-ids"
BODY_TIMEOUT_S = 30.0
_STATUS_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def request_key(request: Request) -> str | None:
    """The client's idempotency key: ``Idempotency-Key`` or ``X-Request-Id`` (at most 256 characters)."""
    key = request.headers.get("idempotency-key") or request.headers.get("x-request-id")
    return key[:256] if key else None


ErrorShape = Callable[[ProxyError], JSONDict]  # a protocol's error body


def error_response(
    exc: ProxyError, headers: dict[str, str] | None = None, shape: ErrorShape = ProxyError.body
) -> Response:
    if exc.status == 401:  # then the connection closes: a client without the key holds no socket
        headers = {**(headers or {}), "Connection": "close"}
    return Response(
        orjson.dumps(shape(exc)), status_code=exc.status, media_type="application/json", headers=headers
    )


def _json(body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, media_type="application/json", headers=headers)


class BearerAuth:
    """Checks ``Authorization: Bearer <key>`` (or ``X-Api-Key: <key>``, which the anthropic client
    sends) in constant time. Holds the key where a traceback that prints local variables cannot show
    it (its repr names no key)."""

    __slots__ = ("_expected", "_key")

    def __init__(self, key: SecretStr | str | None) -> None:
        secret = key.get_secret_value() if isinstance(key, SecretStr) else key
        self._expected = f"Bearer {secret}".encode() if secret else None
        self._key = secret.encode() if secret else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def allows(self, request: Request) -> bool:
        """The proxy's key, or on a per-attempt route that attempt's own key (attempt_keys.py)."""
        if self._expected is None or self._key is None:
            return True
        api_key = request.headers.get("x-api-key")
        if api_key is not None and "authorization" not in request.headers:
            got = b"Bearer " + api_key.encode()
        else:
            got = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(got, self._expected):
            return True
        rid, aid = request.path_params.get("rollout_id"), request.path_params.get("attempt_id")
        if not rid or not aid:
            return False
        return hmac.compare_digest(got, b"Bearer " + attempt_key(self._key.decode(), rid, aid).encode())

    def __repr__(self) -> str:
        return f"BearerAuth(required={self.required})"


def _unauthorized() -> ProxyError:
    return ProxyError(401, "missing or wrong bearer token (Authorization: Bearer <api_key>, or "
                      "X-Api-Key: <api_key>)", "authentication_error", code="invalid_api_key")  # fmt: skip


Handler = Callable[[Request, Target, dict[str, str]], Awaitable[Response]]


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
    routes = _Routes(
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


def _add_openai_routes(app: Starlette, routes: _Routes) -> None:
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


def _add_session_routes(app: Starlette, routes: _Routes) -> None:
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
    return _json(b'{"status":"ok"}')


def _want_ids(request: Request, body: Any) -> bool:
    flag = request.headers.get(RETURN_IDS_HEADER, "").lower() in ("1", "true", "yes")
    return flag or bool(body.get("return_token_ids"))


class _Routes:
    """The routes' handlers and what they share: the service, who may call (``auth``: the per-attempt
    routes; ``access``: the session routes) and the request body's limits."""

    def __init__(
        self,
        service: ProxyService,
        *,
        auth: BearerAuth,
        access: AppKeys,
        max_body_bytes: int,
        body_timeout_s: float,
        bound_host: str | None,
    ) -> None:
        self.service, self.auth, self.access = service, auth, access
        self.max_body_bytes, self.body_timeout_s, self.bound_host = max_body_bytes, body_timeout_s, bound_host

    def app_caller(self, request: Request) -> Caller:
        """The caller of an app-facing route: 401 without an accepted key; 403 from a web page (another
        origin, or a foreign Host on loopback); 415 for a POST that is not JSON."""
        caller = self.access.caller(request)
        if caller is None:
            raise _unauthorized()
        check_browser(request, self.bound_host)
        check_json(request)
        return caller

    async def read_json(self, request: Request) -> Any:
        max_body_bytes, body_timeout_s = self.max_body_bytes, self.body_timeout_s
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ProxyError(
                413, f"the body has {declared} bytes; the limit is {max_body_bytes}", code="request_too_large"
            )
        chunks, size = [], 0
        try:
            with anyio.fail_after(body_timeout_s):  # also the server's body deadline (http_limits)
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        raise ProxyError(
                            413,
                            f"the body exceeds the limit of {max_body_bytes} bytes",
                            code="request_too_large",
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise ProxyError(
                408, f"the body did not arrive within {body_timeout_s:g}s", code="request_timeout"
            ) from None
        except ClientDisconnect:  # gone (or cut off by the server's body deadline): nobody to answer
            raise ProxyError(
                408, "the client disconnected before its body arrived", code="request_timeout"
            ) from None
        try:
            return orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None

    def session_target(self, request: Request) -> tuple[Target, dict[str, str]]:
        caller = self.app_caller(request)
        # Codex CLI names its thread in a ``session-id`` header: its calls then form one session
        sid = (
            request.headers.get(SESSION_HEADER)
            or request.headers.get(CODEX_SESSION_HEADER)
            or new_session_id()
        )
        if not valid_session_id(sid):
            raise bad_request(
                f"{SESSION_HEADER} must be 1-128 characters of [A-Za-z0-9._:-], got {sid!r:.60}"
            )
        held = self.service.sessions.get(sid)
        if held is not None and not caller.may_use(held.owner):  # another key's session: as if unknown
            raise session_not_found(sid)
        return Target(session_id=sid, owner=caller.owner, admin=caller.admin), {"X-Session-Id": sid}

    def guarded(
        self, handler: Handler, session: bool, shape: ErrorShape = ProxyError.body
    ) -> Callable[..., Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            headers: dict[str, str] = {}
            try:
                if session:
                    target, headers = self.session_target(request)
                else:
                    if not self.auth.allows(request):
                        raise _unauthorized()
                    params = request.path_params
                    target = Target(rollout_id=params["rollout_id"], attempt_id=params["attempt_id"])
                return await handler(request, target, headers)
            except ProxyError as exc:
                return error_response(exc, headers, shape)
            except Exception as exc:  # never a 500: log it and say the service is unavailable
                log.exception("unexpected proxy error", path=request.url.path, error=repr(exc)[:300])
                return error_response(
                    ProxyError(503, f"internal proxy error: {type(exc).__name__}", "service_unavailable"),
                    headers,
                    shape,
                )

        return endpoint

    # ------------------------------------------------------------ the model routes (both prefixes)

    async def chat(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req: ChatCompletionRequest = parse_model(ChatCompletionRequest, body, "chat completion request")
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target, req, body["messages"], request_key=request_key(request), client_gone=client.gone
            )
        ids, lps = _want_ids(request, body), bool(req.logprobs)
        if req.stream:
            chunks = responses.chat_chunks(gen, service.tokenizer, lps, ids, req.include_usage)
            return _stream(chunks, headers)
        return _json(responses.chat_json(gen, service.tokenizer, lps, ids), headers)

    async def completions(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req: CompletionRequest = parse_model(CompletionRequest, body, "completion request")
        with ClientWatch(request.receive) as client:
            gen = await service.complete(
                target, req, request_key=request_key(request), client_gone=client.gone
            )
        ids, lps = _want_ids(request, body), req.logprobs is not None
        if req.stream:
            return _stream(
                responses.completion_chunks(gen, service.tokenizer, ids, req.include_usage), headers
            )
        return _json(responses.completion_json(gen, service.tokenizer, lps, ids), headers)

    async def messages(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req, chat_req, chat_messages = anthropic.parse(body)
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target, chat_req, chat_messages, request_key=request_key(request), client_gone=client.gone,
                any_model=req.model.startswith("claude"),
            )  # fmt: skip
        ids, stops = _want_ids(request, body), req.stop_sequences or []
        if req.stream:
            return _stream(
                anthropic_output.message_events(gen, service.tokenizer, stops, ids, req.thinks), headers
            )
        return _json(anthropic_output.message_json(gen, service.tokenizer, stops, ids, req.thinks), headers)

    async def count_tokens(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        chat_req = anthropic.parse_count(body)
        if not str(chat_req.model).startswith("claude"):
            service.check_model(target, chat_req.model)
        await service.check_live(target)
        return _json(orjson.dumps({"input_tokens": service.count_prompt_tokens(chat_req)}), headers)

    async def responses_api(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        parsed = openai_responses.parse(body, service.responses, target.key)
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target,
                parsed.chat,
                parsed.messages,
                request_key=request_key(request),
                client_gone=client.gone,
            )
        answer = responses_output.answer(gen, parsed)
        responses_output.keep(answer, service.responses, target.key)
        ids = _want_ids(request, body)
        if parsed.req.stream:
            return _stream(responses_output.response_events(answer, service.tokenizer, ids), headers)
        return _json(responses_output.response_json(answer, service.tokenizer, ids), headers)

    async def models(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        if target.session_id is None:
            await service.check_live(target)
        card = {"id": service.model_name, "object": "model", "created": int(time.time()), "owned_by": "agentloop",
                "max_model_len": service.engine.max_context}  # fmt: skip
        return _json(orjson.dumps({"object": "list", "data": [card]}), headers)

    # ------------------------------------------------------------ the session routes

    async def post_reward(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            caller = self.app_caller(request)
            body = await self.read_json(request)
            req: RewardRequest = parse_model(RewardRequest, body, "reward")
            rec = await self.service.add_session_reward(
                session_id, Reward(value=req.value, name=req.name), caller.owner, any_owner=caller.admin
            )
            return _json(orjson.dumps({"session_id": session_id, "num_calls": len(rec.calls),
                                       "rewards": [r.model_dump() for r in rec.rewards]}))  # fmt: skip
        except ProxyError as exc:
            return error_response(exc)

    async def get_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            caller = self.app_caller(request)
        except ProxyError as exc:
            return error_response(exc)
        rec = self.service.sessions.get(session_id)
        if rec is None or not caller.may_use(rec.owner):  # another key's session: as if unknown
            return error_response(session_not_found(session_id))
        return _json(orjson.dumps(rec.to_json()))

    async def list_sessions(self, request: Request) -> Response:
        try:
            caller = self.app_caller(request)
        except ProxyError as exc:
            return error_response(exc)
        data = [rec.summary() for rec in self.service.sessions.records() if caller.may_use(rec.owner)]
        return _json(orjson.dumps({"object": "list", "data": data}))


def _stream(chunks: Iterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:  # async: a sync iterator would cost a thread hop per chunk
        for chunk in chunks:
            yield chunk

    hdrs = {"Cache-Control": "no-cache", **headers}
    return StreamingResponse(body(), media_type="text/event-stream", headers=hdrs)
