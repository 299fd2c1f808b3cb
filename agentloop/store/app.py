"""The store's ASGI app: ``create_app`` and its routes (rollouts, attempts, spans, waits, resources).

The rules the routes enforce (the error answers, keys and roles, the long-poll cap) are told in
agentloop/store/server.py's docstring; StoreServer there serves this app.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from agentloop.resources import Resources
from agentloop.store._http_json import (
    DequeueBody,
    EnqueueBody,
    ListBody,
    UpdateAttemptBody,
    WaitBody,
    _HTTPError,
    _json,
)
from agentloop.store._keys import Key, Keys, Who, admin_key_of
from agentloop.store._route_table import _Router, _Routes, for_runner
from agentloop.store.base import Store
from agentloop.store.client import ATTEMPT_LIST, MAX_WAIT_S, ROLLOUT_ATTEMPT, ROLLOUT_LIST, SPAN_LIST
from agentloop.types import LLMCall, Span

MAX_WAITS_PER_KEY = 16  # long-polls (/v1/wait) one key may hold at once; a runner needs one or two


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
