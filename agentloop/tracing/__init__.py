"""OpenTelemetry export: each finished rollout as one trace, through the official SDK (off by default).

Turn it on in the process that runs the :class:`~agentloop.runner.Runner` (the trainer's process
for ``Trainer.fit``; each ``agentloop runner`` process for remote runners)::

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from agentloop import tracing

    tracing.configure(exporter=OTLPSpanExporter())    # or tracer_provider=..., or nothing: the global one
    ...                                               # run / train as usual
    tracing.shutdown()                                # flush what is queued

or with the standard variables and no code: ``OTEL_TRACES_EXPORTER=otlp`` (or ``console``; any name an
installed package registers), ``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ...

The trace of one rollout, built from what the store recorded when the rollout finishes::

    agentloop.rollout                  enqueue -> end; status, mode, attempts, reward
    ├── agentloop.attempt              start -> end of attempt 1; status -> span status, reward events
    │   ├── chat <model>               one per LLM call: GenAI attributes (model, token counts, finish reason)
    │   ├── execute_tool <name>        one per ToolCall span (ToolAgent records them)
    │   └── chat <model>
    └── agentloop.attempt              attempt 2 (a retry)

Every name and attribute is listed in :mod:`agentloop.tracing._spans`, which makes them.

Why from the store: the proxy, the runner and the trainer may live in different processes; the store
has every timestamp (LLM call and tool spans carry their end time and latency), so the runner that
ends a rollout reads it back once and hands it to the SDK. The rollout's trace appears when the
rollout is finished, and only then; a rollout that ends without a runner reporting it (its runner
died and the watchdog ended it; cancelled before any attempt) is not exported: call
:func:`export_rollout` for those yourself. A reward added after the end (an LLM judge's) is not in it.

Costs and faults: when off, nothing is imported (``import agentloop`` never imports opentelemetry) and
the runner does one check per attempt. When on, the runner reads the rollout after each attempt and,
for the attempt that finished it, its attempts and spans (1 + attempts more reads, all bounded by
``timeout_s``), and puts them on a bounded queue;
one daemon thread builds the spans (``configure(exporter=...)`` ends them into a
``BatchSpanProcessor``). A slow or failing exporter never stalls or fails a rollout: the queue drops
with a warning when full, and errors are logged, never raised.

Content: prompts, completions, tool arguments and results, the task, log fields, exception messages and tracebacks stay out
of spans unless ``capture_content=True`` (or ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``).
Token ids never go into spans; their counts do.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio

from agentloop._version import __version__
from agentloop.logging import get_logger
from agentloop.tracing._spans import Job, emit

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer, TracerProvider

    from agentloop.store.base import Store

log = get_logger("agentloop.tracing")

__all__ = ["configure", "enabled", "export_rollout", "force_flush", "shutdown"]

_MAX_QUEUED = 256  # finished rollouts waiting for the span thread; each holds its spans (token ids too)


class _Pipeline:
    """The configuration in force: a tracer, what to record, and the thread that turns jobs into spans."""

    def __init__(
        self, tracer: Tracer, provider: Any, owned: bool, capture_content: bool, timeout_s: float
    ) -> None:
        self.tracer, self.provider, self.owned = tracer, provider, owned
        self.capture_content, self.timeout_s = capture_content, timeout_s
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=_MAX_QUEUED)
        self.dropped = 0
        self.failed = 0
        # daemon: an exporter that hangs must not keep the process alive at exit
        self.thread = threading.Thread(target=self._work, name="agentloop-tracing", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> bool:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "trace_dropped",
                    reason=f"{_MAX_QUEUED} finished rollouts already wait for the span thread (slow exporter?)",
                    dropped=self.dropped,
                )
            return False
        return True

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                emit(self.tracer, job, self.capture_content)
            except Exception as exc:  # a broken tracer or processor: log, keep going
                self.failed += 1
                if self.failed == 1 or self.failed % 1000 == 0:
                    log.warning("trace_export_failed", error=repr(exc), failed=self.failed)
            finally:
                self.queue.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the queued rollouts are spans and the provider has exported them."""
        deadline = time.monotonic() + timeout_s
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.queue.all_tasks_done.wait(left)
        flush = getattr(self.provider, "force_flush", None)  # an SDK provider; the API one has none
        if flush is None:
            return True
        left_s = max(deadline - time.monotonic(), 0.001)
        # the SDK's BatchSpanProcessor.force_flush exports inline and ignores its timeout: bound it here
        done, flushed = _bounded(lambda: flush(max(int(left_s * 1000), 1)), left_s, "force_flush")
        return done and bool(flushed)

    def close(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        try:
            self.queue.put(None, timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Full:
            pass  # the thread is stuck in an exporter; it is a daemon and dies with the process
        self.thread.join(max(deadline - time.monotonic(), 0.01))
        if self.owned:
            # joins the processor's worker, then the exporter's shutdown: either can hang on a dead collector
            _bounded(self.provider.shutdown, max(deadline - time.monotonic(), 0.01), "shutdown")


def _bounded(fn: Any, timeout_s: float, what: str) -> tuple[bool, Any]:
    """Run ``fn()`` on a daemon thread and wait at most ``timeout_s``: (finished, its result).

    Trap: what does not finish is abandoned, not stopped; the thread is a daemon, so it never keeps
    the process alive (an exporter stuck on a collector that never answers)."""
    result: list[Any] = []

    def call() -> None:
        try:
            result.append(fn())
        except Exception as exc:  # a broken provider or exporter: logged, never raised
            log.warning("tracing_provider_failed", call=what, error=repr(exc)[:300])
            result.append(None)

    thread = threading.Thread(target=call, name=f"agentloop-otel-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning(
            "tracing_gave_up",
            call=what,
            timeout_s=round(timeout_s, 3),
            reason="the exporter did not return in time (collector unreachable?); abandoned",
        )
        return False, None
    return True, result[0]


# The pipeline in force (None: off). Module state like logging's configuration: a process exports its
# rollouts to one place; configure() replaces it, shutdown() ends it.
_pipeline: _Pipeline | None = None
_env_checked = False  # OTEL_TRACES_EXPORTER is read once, at the first check, unless configure() came first
_lock = threading.Lock()


def configure(
    tracer_provider: TracerProvider | None = None,
    *,
    exporter: SpanExporter | None = None,
    capture_content: bool | None = None,
    timeout_s: float = 10.0,
) -> None:
    """Export every rollout this process's runners finish as an OpenTelemetry trace.

    ``exporter``: a ``SpanExporter`` (OTLP, console, in-memory); agentloop makes a ``TracerProvider``
    (service name ``agentloop`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` set one)
    with a ``BatchSpanProcessor`` around it, and shuts it down in :func:`shutdown`.
    ``tracer_provider``: yours, used as is (give it a ``BatchSpanProcessor``: a ``SimpleSpanProcessor``
    exports on agentloop's span thread, one span at a time). Neither: the global provider
    (``opentelemetry.trace.set_tracer_provider``, or the one ``opentelemetry-instrument`` set up).
    ``capture_content``: put messages, completions, tool arguments and results, the task and tracebacks
    in spans; None reads ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (default: off).
    ``timeout_s``: how long the runner may spend reading one finished rollout from the store.
    Calling it again replaces the configuration (the previous one is flushed first).
    """
    global _pipeline, _env_checked
    if tracer_provider is not None and exporter is not None:
        raise ValueError(
            "configure takes a tracer_provider or an exporter, not both; "
            "add the exporter to your provider (provider.add_span_processor(BatchSpanProcessor(exporter)))"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    if capture_content is None:
        capture_content = _env_flag("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")
    from opentelemetry import trace

    owned = False
    if exporter is not None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider: Any = _new_provider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        owned = True
    elif tracer_provider is not None:
        if not callable(getattr(tracer_provider, "get_tracer", None)):
            raise TypeError(
                f"tracer_provider must be an opentelemetry TracerProvider, got {type(tracer_provider).__name__}"
            )
        provider = tracer_provider
    else:
        provider = trace.get_tracer_provider()
    tracer = provider.get_tracer("agentloop", __version__)
    new = _Pipeline(tracer, provider, owned, bool(capture_content), float(timeout_s))
    with _lock:
        old, _pipeline, _env_checked = _pipeline, new, True
    # at exit, flush the queue into the provider before the provider's own exit hook (registered when it
    # was made, earlier) shuts it down: hooks run last-registered first
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    if old is not None:
        old.close(timeout_s)


def shutdown(timeout_s: float = 30.0) -> None:
    """Flush the queued rollouts and stop exporting (a provider made from ``exporter=`` is shut down;
    one you passed stays yours). Blocks up to ``timeout_s``: call it from sync code, after the run."""
    global _pipeline, _env_checked
    with _lock:
        old, _pipeline, _env_checked = _pipeline, None, True
    if old is not None:
        old.close(timeout_s)


def _at_exit() -> None:
    shutdown(timeout_s=5.0)


def force_flush(timeout_s: float = 30.0) -> bool:
    """Wait until every finished rollout handed over so far is exported; False if ``timeout_s`` ran out.
    Blocks: from async code, ``await anyio.to_thread.run_sync(tracing.force_flush)``."""
    pipeline = _pipeline
    return pipeline.flush(timeout_s) if pipeline is not None else True


def enabled() -> bool:
    """Whether finished rollouts are exported (``configure`` was called, or ``OTEL_TRACES_EXPORTER`` is set)."""
    return _active() is not None


async def export_rollout(
    store: Store, rollout_id: str, *, attempt_id: str | None = None, agent_name: str | None = None
) -> bool:
    """Hand the trace of a finished rollout to the SDK; True if it was queued for export.

    Nothing happens (False) when tracing is off, the rollout is not finished, or ``attempt_id`` is
    given and is not the rollout's last attempt (only the runner of the last attempt exports, so each
    rollout is exported once). Store errors and timeouts are logged, never raised. The Runner calls
    this after each attempt; call it yourself for rollouts that ended without a runner.
    """
    pipeline = _active()
    if pipeline is None:
        return False
    try:
        with anyio.fail_after(pipeline.timeout_s):
            rollout = await store.get_rollout(rollout_id)
            if not rollout.status.is_terminal:
                return False
            attempts = sorted(await store.list_attempts(rollout_id), key=lambda a: a.sequence_id)
            if attempt_id is not None and (not attempts or attempts[-1].attempt_id != attempt_id):
                return False
            spans = [await store.query_spans(rollout_id, a.attempt_id) for a in attempts]
    except Exception as exc:  # TimeoutError included: the trace is lost, the rollout is not
        log.warning("trace_read_failed", rollout_id=rollout_id, error=repr(exc))
        return False
    return pipeline.submit(Job(rollout, attempts, spans, agent_name))


# ---------------------------------------------------------------- configuration helpers


def _active() -> _Pipeline | None:
    global _env_checked
    if _pipeline is not None or _env_checked:
        return _pipeline
    with _lock:
        if _env_checked:
            return _pipeline
        _env_checked = True
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names or names == ["none"] or _env_flag("OTEL_SDK_DISABLED"):
        return None
    try:
        _configure_from_environment(names)
    except Exception as exc:  # a bad variable must not stop the runner: say so once, stay off
        log.warning("tracing_not_configured", OTEL_TRACES_EXPORTER=",".join(names), error=str(exc))
    return _pipeline


def _configure_from_environment(names: list[str]) -> None:
    from importlib.metadata import entry_points

    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        configure()  # someone (opentelemetry-instrument) already built the pipeline from the variables
        return
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = _new_provider()
    for name in names:
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise ValueError(
                f"no installed package provides the span exporter {name!r} "
                "(otlp: pip install opentelemetry-exporter-otlp; console comes with opentelemetry-sdk)"
            )
        provider.add_span_processor(BatchSpanProcessor(next(iter(found)).load()()))
    configure(provider)
    assert _pipeline is not None
    _pipeline.owned = True  # made here: shutdown() shuts it down


def _new_provider() -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "agentloop"}))
    # shutdown_on_exit=False: the SDK's own exit hook would shut it down unbounded (a hung exporter
    # then keeps the process from exiting); ours (_at_exit) does it within a timeout
    return TracerProvider(resource=resource, shutdown_on_exit=False)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
