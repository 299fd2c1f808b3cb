"""StoreServer: one store shared over HTTP by runners in other processes or machines (their side:
StoreClient, agentloop.store.client).

JSON only (never pickle). Every bad request gets a 4xx with ``{"error": {"message", "type"}}``:

=====  ====================  =========================================
code   type                  the client raises
=====  ====================  =========================================
400    invalid_json          InvalidRequestError
401    unauthorized          StoreUnavailableError (wrong or no key)
403    forbidden             InvalidRequestError (a runner key used for an admin route, for an
                             attempt another runner dequeued, or to post an llm_call span)
404    not_found             NotFoundError
409    stale_attempt         StaleAttemptError
409    invalid_transition    InvalidTransitionError
413    payload_too_large     InvalidRequestError
422    invalid_request       InvalidRequestError (NaN/Infinity, a reward over +-1e6, JSON nested too
                             deep, ...)
429    too_many_waits        StoreUnavailableError (more than max_waits_per_key long-polls at once)
=====  ====================  =========================================

The connection limits (agentloop.http_limits, ``limits=``) answer in plain text and close the
connection: 408 (request head or body not sent in time), 431 (head over 32 KiB), 503 (every connection
busy); the client raises StoreUnavailableError for each.

Keys and roles. With no key the server is open (and binds only a loopback address). The **admin key**
(``admin_key``, or ``api_key`` as before) may do everything: the trainer holds it. A **runner key**
(``runner_keys={"name": key}``, or ``runner_key(admin_key, name)``, which a server with that admin key
accepts without being told) may:

- dequeue, and read only the attempts it dequeued (the attempt's worker_id is stored as
  ``name/<worker_id>``), their spans, and the rollouts they belong to (``get_rollout``, ``list_attempts``
  shows its own attempts only, ``wait_for_rollouts`` on those rollouts only);
- write status, heartbeats and spans into those attempts: rewards, logs and tool calls, never an
  ``llm_call`` span (only the proxy records what the model produced; it writes to the store directly);
- read resources, with every ProxyLLM's ``api_key`` blanked (each attempt gets its own proxy credential
  when it is dequeued: agentloop.proxy.attempt_keys).

It may not list rollouts, enqueue or cancel them, run the watchdog for everyone, or add resources.
A task's ``reference`` field (``input["reference"]`` of a dict input: the answer, a hidden test) never
reaches a runner key: it is removed from every rollout it reads, so only trainer-side scorers (a judge,
a reward computed by the trainer) see it. Violations are 403 with the rule in the message.

Long-polls (``/v1/wait``) are capped per key (``max_waits_per_key``, default 16 at once); one more is
answered 429 ``too_many_waits``, so no key can hold every connection with waits.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import orjson
import structlog
from anyio.abc import TaskStatus
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from agentloop.errors import (
    AgentLoopError,
    InvalidRequestError,
    InvalidTransitionError,
    NotFoundError,
    StaleAttemptError,
)
from agentloop.http_limits import HttpLimits, is_loopback
from agentloop.http_server import EmbeddedServer, ServerState
from agentloop.resources import ProxyLLM, Resources
from agentloop.store._keys import Key, Keys, Who, admin_key_of, owner_of, runner_key
from agentloop.store.base import Store
from agentloop.store.client import ATTEMPT_LIST, MAX_WAIT_S, ROLLOUT_ATTEMPT, ROLLOUT_LIST, SPAN_LIST
from agentloop.types import (
    JSON,
    AttemptStatus,
    ErrorInfo,
    LLMCall,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
)

log = structlog.get_logger(__name__)

_OWNERS_CACHED = 65_536  # attempt -> dequeuing runner, kept in memory; older ones are read from the store
MAX_WAITS_PER_KEY = 16  # long-polls (/v1/wait) one key may hold at once; a runner needs one or two
REFERENCE_FIELD = "reference"  # input["reference"]: the task's answer, never handed to a runner key


def for_runner(rollout: Any) -> Any:
    """``rollout`` (a Rollout or AttemptedRollout) as a runner key sees it: without ``input["reference"]``."""
    if isinstance(rollout, Rollout) and isinstance(rollout.input, dict) and REFERENCE_FIELD in rollout.input:
        kept = {k: v for k, v in rollout.input.items() if k != REFERENCE_FIELD}
        return rollout.model_copy(update={"input": kept})
    return rollout


def _blank_proxy_keys(resources: Resources | None) -> Resources | None:
    """Resources as a runner key reads them: no ProxyLLM's ``api_key`` (each attempt gets its own)."""
    if resources is None or not any(isinstance(r, ProxyLLM) for r in resources.items.values()):
        return resources
    items = {
        name: r.model_copy(update={"api_key": "EMPTY"}) if isinstance(r, ProxyLLM) else r
        for name, r in resources.items.items()
    }
    return resources.model_copy(update={"items": items})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EnqueueBody(_Body):
    input: JSON
    mode: RolloutMode = "train"
    config: RolloutConfig | None = None
    metadata: dict[str, JSON] | None = None


class DequeueBody(_Body):
    worker_id: str | None = None


class UpdateAttemptBody(_Body):
    status: AttemptStatus | None = None
    error: ErrorInfo | None = None
    heartbeat: bool = False


class WaitBody(_Body):
    rollout_ids: list[str]
    timeout: float = Field(ge=0, description="Seconds; the server waits at most MAX_WAIT_S.")


class ListBody(_Body):
    status: list[str] | None = None
    limit: int | None = Field(None, ge=0)


class _HTTPError(Exception):
    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


def _error(status: int, type_: str, message: str) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": type_}})
    return Response(body, status_code=status, media_type="application/json")


def _json(value: Any, adapter: TypeAdapter[Any] | None = None) -> Response:
    if adapter is not None:
        data = adapter.dump_json(value)
    elif isinstance(value, BaseModel):
        data = value.__pydantic_serializer__.to_json(value)
    elif value is None:
        data = b"null"
    else:
        data = orjson.dumps(value)
    return Response(data, media_type="application/json")


def _validation_message(exc: ValidationError) -> tuple[int, str, str]:
    errs = exc.errors(include_url=False, include_input=False)
    if any(e["type"] == "json_invalid" for e in errs):
        return 400, "invalid_json", f"request body is not valid JSON: {errs[0]['msg']}"
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errs[:10]]
    return 422, "invalid_request", "invalid request: " + "; ".join(parts)


Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    store: Store,
    api_key: Key | None = None,
    max_body_bytes: int = 16 * 2**20,
    *,
    admin_key: Key | None = None,
    runner_keys: Mapping[str, Key] | None = None,
    max_waits_per_key: int = MAX_WAITS_PER_KEY,
) -> _Router:
    """The ASGI app serving ``store``: hand-routed (no dependency solving, no middleware); every route
    answers JSON. ``api_key`` is the admin key (kept for callers from before roles)."""
    routes = _Routes(
        store, Keys(admin_key_of(api_key, admin_key), runner_keys), max_body_bytes, max_waits_per_key
    )
    _add_rollout_routes(routes)  # the order is the match order: a literal path before its {pattern}
    _add_attempt_routes(routes)
    _add_wait_routes(routes)
    _add_resource_routes(routes)
    return _Router(routes.table)


class _Routes:
    """What the store's routes share: the store, the keys, the attempts' owners, the long-polls open
    per key, and the route table (``route`` adds to it)."""

    def __init__(self, store: Store, keys: Keys, max_body_bytes: int, max_waits_per_key: int) -> None:
        self.store, self.keys = store, keys
        self.max_body_bytes, self.max_waits_per_key = max_body_bytes, max_waits_per_key
        self.owners: dict[str, str | None] = {}  # attempt_id -> runner that dequeued it (a bounded cache)
        self.waits: dict[Who, int] = {}  # long-polls open per key
        self.table: list[tuple[str, re.Pattern[str], Handler]] = []

    def remember(self, attempt_id: str, owner: str | None) -> None:
        owners = self.owners
        if len(owners) >= _OWNERS_CACHED:
            owners.pop(next(iter(owners)))
        owners[attempt_id] = owner

    async def require_owner(
        self, request: Request, rollout_id: str, attempt_id: str, verb: str = "write only to"
    ) -> None:
        """A runner reads and writes only attempts it dequeued (the admin any)."""
        who: Who = request.scope["agentloop.who"]
        if who.runner is None:
            return
        if attempt_id in self.owners:
            owner = self.owners[attempt_id]
        else:
            owner = owner_of((await self.store.get_attempt(rollout_id, attempt_id)).worker_id)
            self.remember(attempt_id, owner)
        if owner != who.runner:
            raise _HTTPError(
                403,
                "forbidden",
                f"runner {who.runner!r} may {verb} attempts it dequeued; attempt {attempt_id:.80} "
                f"of rollout {rollout_id:.80} was dequeued by "
                + (f"runner {owner!r}" if owner else "the admin or another worker"),
            )

    async def own_attempts(self, request: Request, rollout_id: str) -> list[Any] | None:
        """The rollout's attempts a runner dequeued (403 when none: it may not read the rollout); None
        for the admin, who reads every attempt."""
        who: Who = request.scope["agentloop.who"]
        if who.runner is None:
            return None
        mine = [a for a in await self.store.list_attempts(rollout_id) if owner_of(a.worker_id) == who.runner]
        if not mine:
            raise _HTTPError(
                403,
                "forbidden",
                f"runner {who.runner!r} may read only rollouts it dequeued an attempt of; "
                f"rollout {rollout_id:.80} is not one",
            )
        return mine

    @staticmethod
    def shown(request: Request, rollout: Any) -> Any:
        return rollout if request.scope["agentloop.who"].runner is None else for_runner(rollout)

    @staticmethod
    def resources_shown(request: Request, resources: Resources | None) -> Resources | None:
        return resources if request.scope["agentloop.who"].runner is None else _blank_proxy_keys(resources)

    async def body(self, request: Request, model: type[BaseModel]) -> Any:
        max_body_bytes = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise _HTTPError(
                413, "payload_too_large", f"body of {declared} bytes is over the {max_body_bytes} limit"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _HTTPError(413, "payload_too_large", f"body is over the {max_body_bytes} byte limit")
            chunks.append(chunk)
        return model.model_validate_json(b"".join(chunks) or b"null")

    def route(self, method: str, path: str, admin: str | None = None) -> Callable[[Handler], Handler]:
        """Add the decorated handler to the table behind the key check and the errors' answers.
        ``admin``: what the route does, when only the admin key may do it."""

        def deco(fn: Handler) -> Handler:
            async def handler(request: Request) -> Response:
                raw = next((v for k, v in request.scope["headers"] if k == b"authorization"), None)
                who = self.keys.who(raw)
                if who is None:  # answered, then the connection is closed: no slot held without a key
                    resp = _error(401, "unauthorized", "missing or wrong bearer token (Authorization header)")
                    resp.headers["connection"] = "close"
                    return resp
                if admin is not None and who.runner is not None:
                    return _error(
                        403,
                        "forbidden",
                        f"runner {who.runner!r} may not {admin} ({method} {path} needs the admin key)",
                    )
                request.scope["agentloop.who"] = who
                return await _answered(fn, request, path)

            regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path)
            self.table.append((method, re.compile(regex), handler))
            return fn

        return deco


async def _answered(fn: Handler, request: Request, path: str) -> Response:
    """``fn``'s response, or the error response its exception stands for."""
    try:
        return await fn(request)
    except _HTTPError as exc:
        return _error(exc.status, exc.type, exc.message)
    except ValidationError as exc:
        return _error(*_validation_message(exc))
    except NotFoundError as exc:
        return _error(404, "not_found", str(exc))
    except StaleAttemptError as exc:
        return _error(409, "stale_attempt", str(exc))
    except InvalidTransitionError as exc:
        return _error(409, "invalid_transition", str(exc))
    except (InvalidRequestError, ValueError, TypeError) as exc:
        return _error(422, "invalid_request", str(exc))
    except ClientDisconnect:
        return _error(400, "invalid_request", "the client disconnected before sending the body")
    except Exception as exc:  # a bug, not a bad request: say so without the traceback
        log.exception("store request failed", path=path)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")


def _add_rollout_routes(r: _Routes) -> None:
    """Health, enqueue, list, dequeue, read and cancel rollouts."""
    store, route, body = r.store, r.route, r.body

    @route("GET", "/v1/health")
    async def health(request: Request) -> Response:
        return _json({"ok": True})

    @route("POST", "/v1/rollouts", admin="enqueue rollouts")
    async def enqueue(request: Request) -> Response:
        b = await body(request, EnqueueBody)
        return _json(await store.enqueue_rollout(b.input, mode=b.mode, config=b.config, metadata=b.metadata))

    @route("POST", "/v1/rollouts/list", admin="list rollouts (it reads the attempts it dequeued)")
    async def list_rollouts(request: Request) -> Response:
        b = await body(request, ListBody)
        return _json(await store.list_rollouts(status=b.status, limit=b.limit), ROLLOUT_LIST)

    @route("POST", "/v1/dequeue")
    async def dequeue(request: Request) -> Response:
        b, who = await body(request, DequeueBody), request.scope["agentloop.who"]
        worker_id = b.worker_id
        if who.runner is not None:  # the attempt records which runner dequeued it (checked on writes)
            worker_id = who.runner if not worker_id else f"{who.runner}/{worker_id}"
        attempted = await store.dequeue_rollout(worker_id)
        if attempted is not None and who.runner is not None:
            r.remember(attempted.attempt.attempt_id, who.runner)
            attempted = for_runner(attempted)
        return _json(attempted)

    @route("GET", "/v1/rollouts/{rollout_id}")
    async def get_rollout(request: Request) -> Response:
        rid = request.path_params["rollout_id"]
        await r.own_attempts(request, rid)
        return _json(r.shown(request, await store.get_rollout(rid)))

    @route("POST", "/v1/rollouts/{rollout_id}/cancel", admin="cancel rollouts")
    async def cancel(request: Request) -> Response:
        return _json(await store.cancel_rollout(request.path_params["rollout_id"]))


def _add_attempt_routes(r: _Routes) -> None:
    """Read and update attempts; read and add their spans."""
    store, route, body = r.store, r.route, r.body
    require_owner, own_attempts = r.require_owner, r.own_attempts

    @route("GET", "/v1/rollouts/{rollout_id}/attempts")
    async def list_attempts(request: Request) -> Response:
        rid = request.path_params["rollout_id"]
        mine = await own_attempts(request, rid)
        return _json(mine if mine is not None else await store.list_attempts(rid), ATTEMPT_LIST)

    @route("GET", "/v1/rollouts/{rollout_id}/attempts/{attempt_id}")
    async def get_attempt(request: Request) -> Response:
        p = request.path_params
        await require_owner(request, p["rollout_id"], p["attempt_id"], "read only")
        return _json(await store.get_attempt(p["rollout_id"], p["attempt_id"]))

    @route("GET", "/v1/rollouts/{rollout_id}/attempts/{attempt_id}/with_rollout")
    async def get_rollout_attempt(request: Request) -> Response:
        p = request.path_params
        await require_owner(request, p["rollout_id"], p["attempt_id"], "read only")
        rollout, attempt = await store.get_rollout_attempt(p["rollout_id"], p["attempt_id"])
        return _json((r.shown(request, rollout), attempt), ROLLOUT_ATTEMPT)

    @route("POST", "/v1/rollouts/{rollout_id}/attempts/{attempt_id}")
    async def update_attempt(request: Request) -> Response:
        b, p = await body(request, UpdateAttemptBody), request.path_params
        await require_owner(request, p["rollout_id"], p["attempt_id"])
        attempt = await store.update_attempt(p["rollout_id"], p["attempt_id"], b.status, b.error, b.heartbeat)
        return _json(attempt)

    @route("GET", "/v1/rollouts/{rollout_id}/spans")
    async def query_spans(request: Request) -> Response:
        rid = request.path_params["rollout_id"]
        attempt_id = request.query_params.get("attempt_id", "latest")
        if request.scope["agentloop.who"].runner is not None:
            if attempt_id == "latest":  # the latest attempt must be the runner's own
                attempts = await store.list_attempts(rid)
                if not attempts:
                    await own_attempts(request, rid)  # 403: nothing of it was dequeued
                attempt_id = max(attempts, key=lambda a: a.sequence_id).attempt_id
            await require_owner(request, rid, attempt_id, "read only the spans of")
        return _json(await store.query_spans(rid, attempt_id), SPAN_LIST)

    @route("POST", "/v1/spans")
    async def add_span(request: Request) -> Response:
        span = await body(request, Span)
        who: Who = request.scope["agentloop.who"]
        if who.runner is not None and isinstance(span.payload, LLMCall):
            raise _HTTPError(
                403,
                "forbidden",
                f"runner {who.runner!r} may not post llm_call spans: only the proxy records the model's "
                "calls (the trainer trains on their token ids); a runner posts rewards, logs and tool calls",
            )
        await require_owner(request, span.rollout_id, span.attempt_id)
        return _json(await store.add_span(span))


def _add_wait_routes(r: _Routes) -> None:
    """The long-poll on rollouts (capped per key) and the watchdog."""
    store, route, waits, max_waits_per_key = r.store, r.route, r.waits, r.max_waits_per_key

    @route("POST", "/v1/wait")
    async def wait(request: Request) -> Response:
        who: Who = request.scope["agentloop.who"]
        open_now = waits.get(who, 0)
        if open_now >= max_waits_per_key:
            raise _HTTPError(
                429,
                "too_many_waits",
                f"this key already holds {open_now} long-polls (/v1/wait); at most {max_waits_per_key} at "
                "once: wait on several rollouts in one call, or retry when one returns",
            )
        waits[who] = open_now + 1
        try:
            b = await r.body(request, WaitBody)
            if who.runner is not None:
                for rid in dict.fromkeys(b.rollout_ids):
                    await r.own_attempts(request, rid)
            done = await store.wait_for_rollouts(b.rollout_ids, min(b.timeout, MAX_WAIT_S))
        finally:
            waits[who] -= 1
            if not waits[who]:
                del waits[who]
        return _json([r.shown(request, x) for x in done], ROLLOUT_LIST)

    @route("POST", "/v1/check_timeouts", admin="run the watchdog over every attempt (dequeue runs it)")
    async def check_timeouts(request: Request) -> Response:
        return _json(await store.check_timeouts(), ATTEMPT_LIST)


def _add_resource_routes(r: _Routes) -> None:
    """Add resources (the admin) and read them (a runner: with every ProxyLLM's key blanked)."""
    store, route = r.store, r.route

    @route("POST", "/v1/resources", admin="add or replace resources")
    async def add_resources(request: Request) -> Response:
        return _json({"version": await store.add_resources(await r.body(request, Resources))})

    @route("GET", "/v1/resources/latest")
    async def latest_resources(request: Request) -> Response:
        return _json(r.resources_shown(request, await store.get_latest_resources()))

    @route("GET", "/v1/resources/{version}")
    async def get_resources(request: Request) -> Response:
        raw = request.path_params["version"]
        if not raw.isdigit():
            raise _HTTPError(422, "invalid_request", f"resources version must be an integer, got {raw!r:.40}")
        return _json(r.resources_shown(request, await store.get_resources(int(raw))))


class _Router:
    """A minimal ASGI app: match the path, build a Starlette Request, call the route. No middleware
    stack (Starlette's error and exception middlewares cost more than a store call)."""

    def __init__(self, routes: list[tuple[str, re.Pattern[str], Handler]]) -> None:
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        path, method, allowed = scope["path"], scope["method"], False
        for route_method, pattern, fn in self.routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if route_method != method:
                allowed = True
                continue
            scope["path_params"] = match.groupdict()
            response = await fn(Request(scope, receive))
            break
        else:
            if allowed:
                response = _error(405, "method_not_allowed", f"{method} {path}: Method Not Allowed")
            else:
                response = _error(404, "not_found", f"{method} {path}: Not Found")
        await response(scope, receive, send)


class StoreServer:
    """Serve ``store`` over HTTP on ``host:port`` (port 0: a free port; ``.url`` tells the real one).

    ``admin_key`` (or ``api_key``, the same key) and ``runner_keys`` set the roles (module docstring);
    without any key the server binds only a loopback address. ``limits`` bound what a client may hold
    before it sent a request (connections, header/body deadlines, header size; ``HttpLimits``, whose
    defaults need no change); ``max_waits_per_key`` caps the long-polls (``/v1/wait``) each key holds at once
    (more: 429)."""

    def __init__(
        self,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: Key | None = None,
        max_body_bytes: int = 16 * 2**20,
        *,
        admin_key: Key | None = None,
        runner_keys: Mapping[str, Key] | None = None,
        limits: HttpLimits | None = None,
        max_waits_per_key: int = MAX_WAITS_PER_KEY,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise InvalidRequestError(f"port must be an int in 0..65535, got {port!r}")
        if (
            isinstance(max_waits_per_key, bool)
            or not isinstance(max_waits_per_key, int)
            or max_waits_per_key < 1
        ):
            raise InvalidRequestError(f"max_waits_per_key must be an int >= 1, got {max_waits_per_key!r}")
        if limits is not None and not isinstance(limits, HttpLimits):
            raise InvalidRequestError(f"limits must be an HttpLimits, got {type(limits).__name__}")
        self.store, self.host, self.port = store, host, port
        self.limits = limits or HttpLimits()
        admin = admin_key_of(api_key, admin_key)
        self._keys = Keys(admin, runner_keys)
        if self._keys.open and not is_loopback(host):
            raise InvalidRequestError(
                f"refusing to serve the store on {host!r} without a key: anyone who reaches it could read "
                "and rewrite every rollout; pass admin_key= (and runner_keys= for runners), or bind 127.0.0.1"
            )
        self._admin = self._keys.admin
        self.app = create_app(
            store, max_body_bytes=max_body_bytes, admin_key=admin, runner_keys=runner_keys,
            max_waits_per_key=max_waits_per_key,
        )  # fmt: skip
        # keep-alive long (the client keeps idle connections open), so the server rarely closes one the
        # client is about to reuse; stop does not wait for long-poll waits (graceful_s=0)
        self._http = EmbeddedServer(
            self.app, host, port, what="the store server", limits=self.limits, backlog=2048,
            keep_alive_s=75, graceful_s=0,
        )  # fmt: skip

    @property
    def url(self) -> str:
        if self._http.state is not ServerState.RUNNING:
            raise AgentLoopError("StoreServer.url is known once start() returned")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def state(self) -> ServerState:
        return self._http.state

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the server until ``stop()``; ``task_status.started(url)`` once it accepts connections."""
        async with anyio.create_task_group() as tg:
            self.port = await tg.start(self._http.serve)
            task_status.started(self.url)

    async def start(self) -> None:
        """Bind, start serving and return once the server accepts connections."""
        if self._http.state is not ServerState.CREATED:
            raise AgentLoopError(f"StoreServer starts once; this one is {self._http.state.value}")
        self.port = await self._http.start()

    @property
    def open_connections(self) -> int:
        """Connections the server holds open now (at most ``limits.max_connections``)."""
        return self._http.open_connections

    def runner_key(self, name: str) -> str:
        """A key for runner ``name`` that this server accepts (derived from its admin key)."""
        if self._admin is None:
            raise InvalidRequestError("runner keys are derived from the admin key; this server has none")
        return runner_key(self._admin, name)

    async def stop(self) -> None:
        """Stop accepting, finish open requests (server-side waits end within a second) and return."""
        await self._http.stop()

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
