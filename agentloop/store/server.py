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

The app it serves: agentloop/store/app.py (``create_app`` and the routes), _route_table.py (key and owner
checks, a runner's view, errors answered, the router), _http_json.py (request bodies, JSON answers).
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
from anyio.abc import TaskStatus

from agentloop.errors import AgentLoopError, InvalidRequestError
from agentloop.http_limits import HttpLimits, is_loopback
from agentloop.http_server import EmbeddedServer, ServerState
from agentloop.store._keys import Key, Keys, admin_key_of, runner_key
from agentloop.store.app import MAX_WAITS_PER_KEY, create_app
from agentloop.store.base import Store


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
