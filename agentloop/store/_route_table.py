"""The store server's route table (key and owner checks, a runner's view, errors) and its ASGI router."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from agentloop.errors import InvalidRequestError, InvalidTransitionError, NotFoundError, StaleAttemptError
from agentloop.resources import ProxyLLM, Resources
from agentloop.store._http_json import _error, _HTTPError, _validation_message
from agentloop.store._keys import Keys, Who, owner_of
from agentloop.store.base import Store
from agentloop.types import Rollout

log = structlog.get_logger("agentloop.store.server")  # the server's logger name, as before the split

_OWNERS_CACHED = 65_536  # attempt -> dequeuing runner, kept in memory; older ones are read from the store
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


Handler = Callable[[Request], Awaitable[Response]]


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
