"""``Proxy``: the OpenAI-compatible proxy as an object you start and stop from Python.

The uvicorn server runs in the caller's event loop (the engine's ``generate`` is a coroutine of
that loop, so the proxy must share it). Either let a task group own it::

    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)          # returns once the socket listens
        ...
        await proxy.stop()

or call ``await proxy.start()`` / ``await proxy.stop()`` (or ``async with proxy:``), where the
Proxy itself owns the server task and ``stop`` always awaits it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from pydantic import SecretStr

from agentloop.engine.base import InferenceEngine
from agentloop.errors import NotFoundError
from agentloop.http_limits import HttpLimits, check_bind
from agentloop.http_server import EmbeddedServer, ServerState
from agentloop.proxy.access import owner_id
from agentloop.proxy.app import build_app
from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.ledger import TokenLedger
from agentloop.proxy.service import ProxyService
from agentloop.proxy.sessions import SessionTable
from agentloop.proxy.workers import ProxyWorkers
from agentloop.resources import ProxyLLM
from agentloop.store.base import Store
from agentloop.store.sessions import SessionJournal
from agentloop.store.sqlite import SQLiteStore

log = structlog.get_logger("agentloop.proxy")


ProxyState = ServerState  # the proxy's lifecycle states (agentloop.http_server)
_heap_frozen = False


def _freeze_startup_heap() -> None:
    """Once per process: the heap so far (torch, transformers, the engine: ~10^5-10^6 objects) is
    long-lived; freezing it keeps full collections, which stop every thread, from rescanning it while
    the proxy serves (a ~220 ms pause per collection on a 2-core CPU, 5x shorter after)."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()  # garbage is freed first, not frozen with the rest
        gc.freeze()


LEGACY_MODEL_NAME = "agentloop"  # what /models listed before it named the model; still accepted


def served_model_name(engine: InferenceEngine) -> str:
    """The name apps see for ``engine``'s model: its folder's name (``smollm2-135m-instruct``,
    ``Qwen2.5-0.5B-Instruct``; ``Org/Name`` for a Hugging Face hub snapshot), read from the tokenizer's
    ``name_or_path``; ``agentloop`` when the engine does not say."""
    source = str(getattr(engine.tokenizer, "name_or_path", "") or "").rstrip("/")
    if not source:
        return LEGACY_MODEL_NAME
    path = Path(source)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")  # hub cache layout
    return path.name or LEGACY_MODEL_NAME


class Proxy:
    """OpenAI-compatible proxy in front of ``engine`` that records every call in ``store``.

    Args:
        engine: serves token ids; its tokenizer and chat template are used for prompts.
        store: where each call of a rollout attempt is recorded as an LLMCall span.
        host, port: bind address; port 0 picks a free port (see ``.port`` after start). An address
            other than loopback needs ``api_key`` (else ValueError).
        api_key: when set, requests must carry ``Authorization: Bearer <api_key>`` (else 401); kept
            as a SecretStr (``.api_key``), handed to agents through ``as_resource()``. It is also the
            app key of the session routes (``/v1``) unless ``app_keys`` is given.
        app_keys: the keys of the session routes (``/v1``, apps outside training), each owning the
            sessions it creates: another key gets 404 on them (agentloop/proxy/access.py). None: ``api_key``.
        admin_key: may use every session, and is the key of the admin routes (``add_admin_routes``).
        max_body_bytes: larger request bodies get 413.
        limits: connection limit, header and body deadlines, header size (``HttpLimits()``: defaults
            that hold against idle, slow and oversized clients; see agentloop/http_limits.py).
        model_name: the name ``/models`` reports and responses carry when a request names none; by
            default the model folder's name (``served_model_name``). On the session routes (``/v1``)
            a request must name this model, ``agentloop`` (the old name) or none, else 404
            ``model_not_found``; per-attempt routes accept any name (the agent's LLM resource names it).
        record_sessions: save app sessions' calls and rewards in ``store`` when it is a SQLiteStore
            (they survive a restart; see agentloop/proxy/sessions.py); with other stores, or False,
            sessions live in memory only.
        chat_template: overrides the tokenizer's chat template (jinja source).
        engine_timeout_s: longest one generate may take; then the request is aborted and answered 503.
        store_timeout_s: longest one store call may take; then 503.
        default_max_tokens: max_tokens when neither the request nor the LLM resource sets it.
        default_sampling: defaults under the LLM resource's and the request's sampling fields.
        ledger_sweep_s: every so often the token ledgers of finished attempts are released.
        advertise_host: the address clients reach the proxy at, in ``url`` and ``url_template``
            (what agents and remote runners get); default: ``host``, or this machine's address when
            ``host`` is a wildcard (0.0.0.0, ::), which no client can call.
        workers: worker processes that serve the rollouts' calls (agentloop/proxy/workers.py): the
            per-call parsing, templating, tokenizing and recording spread over that many processes
            while the engine stays in this one; 0 (default): all in this process. Needs a SQLiteStore.
            Their ports are ``worker_ports``; ``as_resource()`` routes each rollout to one of them.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | SecretStr | None = None,
        *,
        app_keys: Sequence[str | SecretStr] | None = None,
        admin_key: str | SecretStr | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        limits: HttpLimits | None = None,
        model_name: str | None = None,
        record_sessions: bool = True,
        chat_template: str | None = None,
        engine_timeout_s: float = 600.0,
        store_timeout_s: float = 30.0,
        default_max_tokens: int = 1024,
        default_sampling: dict[str, Any] | None = None,
        max_sessions: int = 10_000,
        ledger_sweep_s: float = 5.0,
        advertise_host: str | None = None,
        workers: int = 0,
    ) -> None:
        _check_settings(engine, port, max_body_bytes, engine_timeout_s, store_timeout_s, ledger_sweep_s,
                        default_max_tokens)  # fmt: skip
        key = _bearer_key(api_key)
        check_bind(host, key, "the proxy", "pass api_key=")
        if app_keys is not None:  # off loopback, the session routes need a key of their own too
            check_bind(host, next((k for k in app_keys if k), None), "the proxy", "pass app_keys=")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        self.engine, self.store, self.host = engine, store, host
        self.advertise_host = advertise_host or (machine_address() if host in _WILDCARDS else host)
        self._api_key = key
        self.limits = limits or HttpLimits()
        self.ledger_sweep_s = ledger_sweep_s  # how often the ledgers of finished attempts are released
        name = model_name or served_model_name(engine)
        keys = [k for k in ([key] if app_keys is None else app_keys) if k]
        self.sessions = _session_table(engine, store, name, record_sessions, max_sessions, keys)
        self.ledger = TokenLedger()
        self.service = ProxyService(
            engine,
            store,
            model_name=name,
            model_aliases=(LEGACY_MODEL_NAME,),
            template=ChatTemplate(engine.tokenizer, chat_template),
            ledger=self.ledger,
            sessions=self.sessions,
            engine_timeout_s=engine_timeout_s,
            store_timeout_s=store_timeout_s,
            default_max_tokens=default_max_tokens,
            default_sampling=default_sampling or {},
        )
        admin = SecretStr(admin_key) if isinstance(admin_key, str) else admin_key
        self._admin_key = admin if admin is not None and admin.get_secret_value() else None
        self.app = build_app(
            self.service,
            api_key=key,
            max_body_bytes=max_body_bytes,
            body_timeout_s=self.limits.body_timeout_s,
            app_keys=app_keys,
            admin_key=self._admin_key,
            bound_host=host,
        )
        worker_settings: dict[str, Any] = {
            "api_key": key, "max_body_bytes": max_body_bytes, "limits": self.limits, "model_name": name,
            "chat_template": chat_template, "engine_timeout_s": engine_timeout_s, "store_timeout_s": store_timeout_s,
            "default_max_tokens": default_max_tokens, "default_sampling": default_sampling,
            "max_sessions": max_sessions, "ledger_sweep_s": ledger_sweep_s, "advertise_host": self.advertise_host,
        }  # fmt: skip
        self._workers = ProxyWorkers(workers, engine, store, host, worker_settings) if workers else None
        self._http = EmbeddedServer(
            self.app, host, port, what="the proxy", limits=self.limits, backlog=4096, keep_alive_s=30,
            graceful_s=5, background=self._sweep_ledger,
        )  # fmt: skip

    # ------------------------------------------------------------ addresses

    @property
    def api_key(self) -> SecretStr | None:
        """The bearer key requests must carry (None: none required, loopback only)."""
        return self._api_key

    @property
    def admin_key(self) -> SecretStr | None:
        """The admin key (None: the admin routes are off)."""
        return self._admin_key

    @property
    def open_connections(self) -> int:
        """Connections the server holds open now (at most ``limits.max_connections``)."""
        return self._http.open_connections

    @property
    def state(self) -> ServerState:
        return self._http.state

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        """``http://<advertise_host>:<port>``: where clients reach the proxy."""
        return self._url(self.port)

    @property
    def url_template(self) -> str:
        """Base URL with ``{rollout_id}`` and ``{attempt_id}`` placeholders (for ProxyLLM)."""
        return self._template(self.port)

    def _url(self, port: int) -> str:
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"http://{host}:{port}"

    def _template(self, port: int) -> str:
        return f"{self._url(port)}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1"

    @property
    def worker_ports(self) -> list[int]:
        """The worker processes' ports (empty without workers or before start)."""
        return self._workers.ports if self._workers is not None else []

    @property
    def worker_url_templates(self) -> list[str]:
        """Each worker's per-attempt URL template (as ``url_template``, on the worker's port)."""
        return [self._template(port) for port in self.worker_ports]

    @property
    def model_name(self) -> str:
        """The served model's name (``/v1/models``)."""
        return self.service.model_name

    @property
    def session_store(self) -> Path | None:
        """The SQLite store app sessions are saved in (None: memory only)."""
        return self.sessions.journal.path if self.sessions.journal is not None else None

    @property
    def session_base_url(self) -> str:
        """Base URL for apps outside training (calls recorded under the X-Session-Id header)."""
        return f"{self.url}/v1"

    def as_resource(
        self,
        model: str | None = None,
        sampling: dict[str, Any] | None = None,
        *,
        enforce_sampling: bool = False,
    ) -> ProxyLLM:
        """A ProxyLLM resource pointing at this proxy (add it to the store's resources).

        ``enforce_sampling``: ``sampling``'s temperature, top_p and top_k win over a request's own."""
        return ProxyLLM(
            url_template=self.url_template,
            worker_url_templates=self.worker_url_templates,
            model=model or self.service.model_name,
            api_key=self._api_key.get_secret_value() if self._api_key is not None else "EMPTY",
            sampling=dict(sampling or {}),
            enforce_sampling=enforce_sampling,
        )

    # ------------------------------------------------------------ lifecycle

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the server until ``stop()``; ``task_status.started(url)`` once the socket listens."""
        if self.state is not ServerState.CREATED:
            raise RuntimeError(f"a Proxy starts once; this one is {self.state.value}")
        await self._start_workers()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(functools.partial(self._http.serve, on_bound=self._bound))
                task_status.started(self.url)
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_workers()

    async def _start_workers(self) -> None:
        if self._workers is not None:
            await self._workers.start()

    async def _stop_workers(self) -> None:
        if self._workers is not None:
            await self._workers.stop()

    def _bound(self, port: int) -> None:
        self.service.url_template = self.url_template  # the port is known: responses name the URL
        _freeze_startup_heap()

    async def _sweep_ledger(self) -> None:
        while True:
            await anyio.sleep(self.ledger_sweep_s)
            await self.release_finished()

    async def release_finished(self, limit: int = 512) -> int:
        """Forget the token ledger of finished attempts (the store says so); returns how many.

        Checks the ``limit`` least recently used conversations, so one sweep costs at most ``limit``
        store reads; runs every ``ledger_sweep_s`` while serving. Sessions are left alone (LRU-bounded).
        """
        released = 0
        for key in self.ledger.keys()[:limit]:
            rid, _, aid = key.partition("/")
            if rid == "session" or not aid:
                continue
            try:
                with anyio.fail_after(5):
                    finished = (await self.store.get_attempt(rid, aid)).status.is_terminal
            except NotFoundError:
                finished = True
            except Exception as exc:  # the store is down: try again next sweep
                log.debug("ledger sweep skipped", error=repr(exc)[:200])
                break
            if finished:
                self.ledger.forget(key)
                released += 1
        return released

    async def start(self) -> str:
        """Start serving in the running event loop; returns the URL once the socket listens."""
        await self._start_workers()
        try:
            await self._http.start(on_bound=self._bound)
        except BaseException:
            await self._stop_workers()
            raise
        return self.url

    async def stop(self) -> None:
        """Stop accepting requests, let in-flight ones finish (up to 5 s), and close the socket."""
        await self._http.stop()
        await self._stop_workers()
        with contextlib.suppress(Exception):  # a failure was logged and answered 503 when it came
            await self.sessions.flush()

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _check_settings(
    engine: InferenceEngine,
    port: int,
    max_body_bytes: int,
    engine_timeout_s: float,
    store_timeout_s: float,
    ledger_sweep_s: float,
    default_max_tokens: int,
) -> None:
    """``Proxy``'s arguments: a ValueError (TypeError for an engine) naming the one out of range."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
    if engine_timeout_s <= 0 or store_timeout_s <= 0:
        raise ValueError(f"timeouts must be > 0, got engine {engine_timeout_s}, store {store_timeout_s}")
    if not ledger_sweep_s > 0:
        raise ValueError(f"ledger_sweep_s must be > 0, got {ledger_sweep_s}")
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    for name in ("generate", "tokenizer", "max_context"):
        if not hasattr(engine, name):
            raise TypeError(
                f"engine must implement InferenceEngine (missing {name!r}); got {type(engine).__name__}"
            )


def _bearer_key(api_key: str | SecretStr | None) -> SecretStr | None:
    """``api_key`` as a SecretStr; None for no key or an empty one."""
    key = api_key if isinstance(api_key, SecretStr) or api_key is None else SecretStr(api_key)
    if key is not None and not key.get_secret_value():
        key = None
    return key


def _session_table(
    engine: InferenceEngine,
    store: Store,
    name: str,
    record_sessions: bool,
    max_sessions: int,
    keys: Sequence[str | SecretStr],
) -> SessionTable:
    """The app sessions' table: saved in ``store`` when it is a SQLiteStore and ``record_sessions``;
    with one app key (``keys``), the sessions saved without an owner become that key's."""
    journal = SessionJournal(store) if record_sessions and isinstance(store, SQLiteStore) else None
    if journal is not None:
        tokenizer_dir = str(getattr(engine.tokenizer, "name_or_path", "") or "")
        journal.set_server({"model": name, "tokenizer": tokenizer_dir})
    sessions = SessionTable(max_sessions=max_sessions, journal=journal)
    if len(keys) == 1:  # sessions saved without an owner (no key, or before owners) are that key's
        adopted = sessions.adopt_unowned(owner_id(keys[0]))
        if adopted:
            log.info("sessions_adopted", sessions=adopted, reason="saved without an owner; one app key")
    return sessions


_WILDCARDS = ("0.0.0.0", "::", "")


def machine_address() -> str:
    """This machine's address on its default route (no packet is sent), else its host name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP connect only picks the outgoing interface
            address = str(probe.getsockname()[0])
        except OSError:
            return socket.gethostname()
    return address if address != "0.0.0.0" else socket.gethostname()
