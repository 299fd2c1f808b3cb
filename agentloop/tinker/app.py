"""The HTTP face of ``agentloop tinker``: the Tinker API's routes as the official SDK calls them.

Every route but ``/api/v1/healthz`` wants the key in ``X-API-Key`` (the SDK's header) or
``Authorization: Bearer``. The client config this server answers turns the SDK's optional paths
off: no JWT exchange (the plain key is used), plain httpx transport (HTTP/1.1), forward_backward
bodies neither compressed nor sent in parallel chunks, one ``retrieve_future`` poll per sample,
custom losses run on the client.

Work that takes time (create_model, forward_backward, optim_step, save/load, sampling) answers a
future at once (``{"request_id"}``); ``/api/v1/retrieve_future`` gives the result (futures.py).
Errors: a bad request is 400 (404 for an unknown id, 401 for a bad key) with ``{"detail": why}``;
never a 500 for something the client sent.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentloop.tinker._proto import ProtoError, decode_forward_backward_request
from agentloop.tinker.futures import FutureState
from agentloop.tinker.losses import LossError
from agentloop.tinker.service import NotFound, TinkerService
from agentloop.tinker.wire import (
    CreateModelRequest,
    CreateSamplingSessionRequest,
    FutureRetrieveRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SessionHeartbeatRequest,
    WireError,
)

__all__ = ["CLIENT_CONFIG", "build_app"]

PROTO = "application/x-protobuf"
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
    "sample_no_retries": False,
}
MAX_JSON_BYTES = 64 * 1024 * 1024

Handler = Callable[[Request], Awaitable[Response]]


class _HttpError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def _json(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    if len(body) > MAX_JSON_BYTES:
        raise _HttpError(413, f"the body has {len(body)} bytes; at most {MAX_JSON_BYTES} are taken")
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise _HttpError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _HttpError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return model.model_validate(data)


def _future(rid: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"request_id": rid, "model_id": model_id, **extra})


def build_app(service: TinkerService, keys: list[SecretStr]) -> Starlette:
    """The Starlette app serving ``service`` to clients holding one of ``keys`` (at least one)."""
    if not keys:
        raise ValueError("the Tinker server needs at least one API key (the SDK always sends one)")
    routes = _Routes([k.get_secret_value().encode() for k in keys])
    _add_session_routes(routes, service)
    _add_training_routes(routes, service)
    _add_sampling_routes(routes, service)
    _add_future_routes(routes, service)
    app = Starlette(routes=routes.routes)
    app.add_route("/{rest:path}", routes.not_served, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    return app


class _Routes:
    """The app's routes (``add`` appends one) and the key check in front of them."""

    def __init__(self, secrets: list[bytes]) -> None:
        self.secrets = secrets
        self.routes: list[Route] = []

    def authorized(self, request: Request) -> bool:
        given = request.headers.get("x-api-key") or ""
        if not given and request.headers.get("authorization", "").lower().startswith("bearer "):
            given = request.headers["authorization"][7:]
        return any(hmac.compare_digest(given.encode(), s) for s in self.secrets)

    def route(self, path: str, methods: list[str], auth: bool = True) -> Callable[[Handler], Route]:
        def wrap(fn: Handler) -> Route:
            async def endpoint(request: Request) -> Response:
                if auth and not self.authorized(request):
                    return JSONResponse(
                        {
                            "detail": "missing or wrong API key: send the server's key (ServiceClient(api_key=...))"
                        },
                        status_code=401,
                    )
                try:
                    return await fn(request)
                except _HttpError as exc:
                    return JSONResponse({"detail": exc.detail}, status_code=exc.status)
                except ValidationError as exc:
                    errors = "; ".join(
                        f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
                    )
                    return JSONResponse({"detail": f"invalid request: {errors}"}, status_code=400)
                except NotFound as exc:
                    return JSONResponse({"detail": str(exc)}, status_code=404)
                except (WireError, ProtoError, LossError) as exc:
                    return JSONResponse({"detail": str(exc)}, status_code=400)

            return Route(path, endpoint, methods=methods)

        return wrap

    def add(self, path: str, methods: list[str], auth: bool = True) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.routes.append(self.route(path, methods, auth)(fn))
            return fn

        return deco

    async def not_served(self, request: Request) -> Response:
        if not self.authorized(request):
            return JSONResponse({"detail": "missing or wrong API key"}, status_code=401)
        return JSONResponse(
            {
                "detail": f"{request.method} {request.url.path} is not served by agentloop tinker (docs/tinker.md lists what is)"
            },
            status_code=404,
        )


def _add_session_routes(routes: _Routes, s: TinkerService) -> None:
    """Health, the client's config, the server's capabilities, sessions and their heartbeats."""
    add = routes.add

    @add("/api/v1/healthz", ["GET"], auth=False)
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @add("/api/v1/client/config", ["POST"])
    async def client_config(request: Request) -> Response:
        return JSONResponse(CLIENT_CONFIG)

    @add("/api/v1/client/dynamic_config", ["POST"])
    async def dynamic_config(request: Request) -> Response:
        return JSONResponse({"refresh_interval_sec": 3600, "sample_cancel_enabled": False})

    @add("/api/v1/get_server_capabilities", ["GET"])
    async def capabilities(request: Request) -> Response:
        return JSONResponse(s.capabilities())

    @add("/api/v1/create_session", ["POST"])
    async def create_session(request: Request) -> Response:
        await request.body()
        return JSONResponse({"type": "create_session", "session_id": s.create_session()})

    @add("/api/v1/session_heartbeat", ["POST"])
    async def heartbeat(request: Request) -> Response:
        s.heartbeat((await _json(request, SessionHeartbeatRequest)).session_id)
        return JSONResponse({"type": "session_heartbeat"})

    @add("/api/v1/sessions/{session_id}/finish", ["POST"])
    async def finish(request: Request) -> Response:
        s.finish_session(request.path_params["session_id"])
        return JSONResponse(None)

    @add("/api/v1/telemetry", ["POST"])
    async def telemetry(request: Request) -> Response:
        await request.body()  # the SDK's own telemetry: accepted and dropped
        return JSONResponse({"status": "accepted"})


def _add_training_routes(routes: _Routes, s: TinkerService) -> None:
    """Training models: create, describe, forward_backward, optim_step, save and load weights."""
    add = routes.add

    @add("/api/v1/create_model", ["POST"])
    async def create_model(request: Request) -> Response:
        req = await _json(request, CreateModelRequest)
        return _future(s.create_model(req))

    @add("/api/v1/get_info", ["POST"])
    async def get_info(request: Request) -> Response:
        return JSONResponse(s.get_info((await _json(request, GetInfoRequest)).model_id))

    @add("/api/v1/forward_backward", ["POST"])
    async def forward_backward(request: Request) -> Response:
        if PROTO not in request.headers.get("content-type", ""):
            raise _HttpError(
                415, f"forward_backward takes a protobuf body (Content-Type: {PROTO}), as the SDK sends"
            )
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise _HttpError(
                415, "compressed forward_backward bodies are not taken; this server's client config says so"
            )
        raw = decode_forward_backward_request(await request.body())
        return _future(s.forward_backward(raw), raw.model_id)

    @add("/api/v1/optim_step", ["POST"])
    async def optim_step(request: Request) -> Response:
        req = await _json(request, OptimStepRequest)
        return _future(s.optim_step(req), req.model_id)

    @add("/api/v1/save_weights", ["POST"])
    async def save_weights(request: Request) -> Response:
        req = await _json(request, SaveWeightsRequest)
        return _future(s.save_weights(req), req.model_id)

    @add("/api/v1/load_weights", ["POST"])
    async def load_weights(request: Request) -> Response:
        req = await _json(request, LoadWeightsRequest)
        return _future(s.load_weights(req), req.model_id)

    @add("/api/v1/save_weights_for_sampler", ["POST"])
    async def save_for_sampler(request: Request) -> Response:
        req = await _json(request, SaveWeightsForSamplerRequest)
        return _future(s.save_weights_for_sampler(req), req.model_id)


def _add_sampling_routes(routes: _Routes, s: TinkerService) -> None:
    """Sampling sessions, samplers and samples."""
    add = routes.add

    @add("/api/v1/create_sampling_session", ["POST"])
    async def create_sampling_session(request: Request) -> Response:
        sid = s.create_sampling_session(await _json(request, CreateSamplingSessionRequest))
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    @add("/api/v1/samplers/{sampler_id:path}", ["GET"])
    async def get_sampler(request: Request) -> Response:
        return JSONResponse(s.get_sampler(request.path_params["sampler_id"]))

    @add("/api/v1/asample", ["POST"])
    async def asample(request: Request) -> Response:
        rid, sequence_ids = s.sample(await _json(request, SampleRequest))
        return _future(rid, sample_sequence_ids=sequence_ids)


def _add_future_routes(routes: _Routes, s: TinkerService) -> None:
    """The futures the routes above answer: their results, and cancelling one."""
    add = routes.add

    @add("/api/v1/retrieve_future", ["POST"])
    async def retrieve_future(request: Request) -> Response:
        req = await _json(request, FutureRetrieveRequest)
        if req.request_id not in s.futures:
            raise NotFound(
                f"future {req.request_id!r} does not exist (finished long ago, or the server restarted)"
            )
        entry = await s.futures.retrieve(req.request_id)
        if entry.state is FutureState.PENDING:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        if entry.state is FutureState.FAILED:
            return JSONResponse({"error": entry.error, "category": entry.category})
        if isinstance(entry.result, bytes):
            return Response(entry.result, media_type=PROTO)
        return JSONResponse(entry.result)

    @add("/api/v1/cancel_future", ["POST"])
    async def cancel_future(request: Request) -> Response:
        body = await _json(request, FutureRetrieveRequest)
        s.futures.cancel(body.request_id)
        return JSONResponse(None)
