"""OpenTelemetry export (agentloop/tracing.py): real runners, a real proxy and store, the tiny model or a
scripted engine, and the SDK's in-memory exporter; spans are checked against what the store recorded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from agentloop import tracing
from agentloop.agent import emit_reward, rollout
from agentloop.engine.factory import load_engine
from agentloop.proxy.server import Proxy
from agentloop.resources import LLM, Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.tools import function_tool
from agentloop.tools.agent import ToolAgent
from agentloop.types import AttemptedRollout, LLMCall, RolloutConfig, ToolCall
from tests.integrations.scripted import scripted_engine, tool_call_text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _tracing_off_after() -> Iterator[None]:
    yield
    tracing.shutdown(timeout_s=5)


@pytest.fixture
def exported() -> InMemorySpanExporter:
    """Tracing on, through configure(exporter=...) (a BatchSpanProcessor around the in-memory exporter)."""
    memory = InMemorySpanExporter()
    tracing.configure(exporter=memory)
    return memory


def finished(memory: InMemorySpanExporter) -> list[ReadableSpan]:
    assert tracing.force_flush(timeout_s=10)
    return sorted(memory.get_finished_spans(), key=lambda s: s.start_time or 0)


def by_name(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def run(
    agent: Any, store: MemoryStore, tasks: list[Any], n: int | None = None, **enqueue: Any
) -> list[str]:
    ids = [(await store.enqueue_rollout(t, **enqueue)).rollout_id for t in tasks]
    with anyio.fail_after(60):
        stats = await Runner(agent, store, concurrency=2, poll_interval=0.01).run(
            max_rollouts=n or len(tasks)
        )
    assert stats.lost == 0
    return ids


# ---------------------------------------------------------------- the tiny model through the proxy


@rollout
async def two_turns(task: dict[str, Any], llm: LLM) -> float:
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=60)
    messages: list[Any] = [{"role": "user", "content": task["question"]}]
    for follow_up in ("And again?", None):
        resp = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    await client.close()
    await emit_reward(0.25, name="format")
    return 1.0


async def test_a_rollout_of_the_tiny_model_is_one_trace_with_genai_attributes(
    tiny_model_dir: Path, exported: InMemorySpanExporter
) -> None:
    engine = load_engine(str(tiny_model_dir), device="cpu", max_context=1024)
    await engine.start()
    store = MemoryStore()
    try:
        async with Proxy(engine, store) as proxy:
            sampling = {"temperature": 0.7, "seed": 3}
            await store.add_resources(Resources(items={"llm": proxy.as_resource("tiny", sampling)}))
            [rid] = await run(two_turns, store, [{"question": "What is 2 + 2?"}])
    finally:
        await engine.stop()
    spans = finished(exported)
    assert [s.name for s in spans] == ["agentloop.rollout", "agentloop.attempt", "chat tiny", "chat tiny"]
    root, attempt, *chats = spans
    assert len({s.context.trace_id for s in spans}) == 1
    assert parent_id(root) is None and parent_id(attempt) == root.context.span_id
    assert [parent_id(c) for c in chats] == [attempt.context.span_id] * 2

    recorded = [s.payload for s in await store.query_spans(rid) if isinstance(s.payload, LLMCall)]
    assert len(recorded) == 2
    for span, call in zip(chats, recorded, strict=True):
        a = dict(span.attributes or {})
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
        assert a["gen_ai.usage.input_tokens"] == len(call.prompt_ids) > 0
        assert a["gen_ai.usage.output_tokens"] == len(call.response_ids) > 0
        assert a["gen_ai.response.finish_reasons"] == (call.finish_reason,)
        assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.seed"] == 3
        assert a["gen_ai.request.max_tokens"] == 6
        assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for k in a)  # no content unless asked
        assert span.kind.name == "CLIENT"
    assert recorded[1].prompt_ids[: len(recorded[0].prompt_ids)] == recorded[0].prompt_ids  # one ledger

    stored_rollout = await store.get_rollout(rid)
    [stored_attempt] = await store.list_attempts(rid)
    assert root.start_time == int(stored_rollout.enqueue_time * 1e9)
    assert root.end_time == int((stored_rollout.end_time or 0) * 1e9)
    assert attempt.start_time == int(stored_attempt.start_time * 1e9)
    assert attempt.end_time == int((stored_attempt.end_time or 0) * 1e9)
    assert attempt.start_time <= chats[0].start_time  # type: ignore[operator]
    assert chats[0].end_time <= chats[1].start_time <= chats[1].end_time <= attempt.end_time  # type: ignore[operator]

    ra, aa = dict(root.attributes or {}), dict(attempt.attributes or {})
    assert ra["agentloop.rollout.id"] == rid and ra["agentloop.rollout.status"] == "succeeded"
    assert ra["agentloop.reward"] == 1.25 and ra["agentloop.rollout.attempts"] == 1
    assert (
        aa["agentloop.attempt.id"] == stored_attempt.attempt_id and aa["agentloop.attempt.sequence_id"] == 1
    )
    assert aa["gen_ai.operation.name"] == "invoke_agent" and aa["gen_ai.agent.name"] == "two_turns"
    assert aa["agentloop.reward"] == 1.25
    rewards = [(e.name, dict(e.attributes or {})) for e in attempt.events]
    assert [(n, a["agentloop.reward.value"], a.get("agentloop.reward.name")) for n, a in rewards] == [
        ("agentloop.reward", 0.25, "format"),
        ("agentloop.reward", 1.0, "final"),
    ]
    assert root.status.status_code is StatusCode.OK and attempt.status.status_code is StatusCode.OK
    assert "What is 2 + 2" not in json.dumps([s.to_json() for s in spans])  # the prompt stays out


# ---------------------------------------------------------------- tools (scripted model choices)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool
def boom(x: int) -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


async def run_tool_agent(tokenizer: Any) -> tuple[MemoryStore, str]:
    script = [
        tool_call_text("add", {"a": 2, "b": 3}) + "\n" + tool_call_text("boom", {"x": 1}),
        "The answer is 5",
    ]
    agent = ToolAgent([add, boom], lambda task, answer: float(answer == "The answer is 5"))
    store = MemoryStore()
    async with Proxy(scripted_engine(tokenizer, script), store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("m", {"max_tokens": 64})}))
        [rid] = await run(agent, store, [{"question": "2+3?"}])
    return store, rid


async def test_tool_calls_are_execute_tool_spans_between_the_llm_calls(
    tiny_model_dir: Path, exported: InMemorySpanExporter
) -> None:
    from transformers import AutoTokenizer

    store, rid = await run_tool_agent(AutoTokenizer.from_pretrained(tiny_model_dir))
    spans = finished(exported)
    names = [s.name for s in spans]
    assert names[:3] == ["agentloop.rollout", "agentloop.attempt", "chat m"] and names[5:] == ["chat m"]
    assert sorted(names[3:5]) == ["execute_tool add", "execute_tool boom"]  # run concurrently
    attempt = spans[1]
    assert all(parent_id(s) == attempt.context.span_id for s in spans[2:])
    assert spans[2].end_time <= min(s.start_time for s in spans[3:5])  # type: ignore[operator,type-var]
    assert max(s.end_time for s in spans[3:5]) <= spans[5].start_time  # type: ignore[operator,type-var]
    [ok], [failed] = by_name(spans, "execute_tool add"), by_name(spans, "execute_tool boom")
    assert dict(ok.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.type": "function",
    }
    assert ok.status.status_code is StatusCode.UNSET
    recorded = [s.payload for s in await store.query_spans(rid) if isinstance(s.payload, ToolCall)]
    assert recorded[1].error and failed.attributes and failed.attributes["error.type"] == recorded[1].error
    assert failed.status.status_code is StatusCode.ERROR
    for span, call in zip((ok, failed), recorded, strict=True):
        assert call.latency_s is not None
        # start = ns(timestamp - latency), end = ns(timestamp), ns(t) = int(t * 1e9): the subtraction rounds
        # to ulp(timestamp) and each ns() to ulp(t * 1e9) ns plus 1 ns of truncation (about 1 us today)
        t = span.end_time / 1e9  # type: ignore[operator]
        tol = 2 * math.ulp(t) + 2 * (math.ulp(t * 1e9) + 1) / 1e9
        assert abs((span.end_time - span.start_time) / 1e9 - call.latency_s) <= tol  # type: ignore[operator]
    assert spans[2].attributes and spans[2].attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    events = [e for e in attempt.events if e.name == "agentloop.log"]
    assert [dict(e.attributes or {}) for e in events] == [
        {"agentloop.log.message": "tool_agent_finished", "agentloop.log.level": "info"}  # no answer text
    ]


async def test_capture_content_puts_messages_and_tool_io_in_spans(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    memory = InMemorySpanExporter()
    tracing.configure(exporter=memory, capture_content=True)
    store, rid = await run_tool_agent(AutoTokenizer.from_pretrained(tiny_model_dir))
    spans = finished(memory)
    calls = [s.payload for s in await store.query_spans(rid) if isinstance(s.payload, LLMCall)]
    chat = by_name(spans, "chat m")[1]
    assert chat.attributes is not None
    assert json.loads(str(chat.attributes["gen_ai.input.messages"])) == calls[1].messages
    assert json.loads(str(chat.attributes["gen_ai.output.messages"])) == [calls[1].response_message]
    tool = by_name(spans, "execute_tool add")[0]
    assert tool.attributes is not None
    assert json.loads(str(tool.attributes["gen_ai.tool.call.arguments"])) == {"a": 2, "b": 3}
    assert json.loads(str(tool.attributes["gen_ai.tool.call.result"])) == "5"
    root = by_name(spans, "agentloop.rollout")[0]
    assert root.attributes and json.loads(str(root.attributes["agentloop.rollout.input"])) == {
        "question": "2+3?"
    }


# ---------------------------------------------------------------- failures and retries (no model)


@rollout
async def fails_first(task: dict[str, Any], llm: LLM | None, rollout: AttemptedRollout) -> float:
    if rollout.attempt.sequence_id == 1 or task.get("always_fail"):
        raise ValueError(f"attempt {rollout.attempt.sequence_id} broke")
    return 1.0


async def test_a_retried_rollout_has_one_attempt_span_per_attempt_and_failures_are_errors(
    exported: InMemorySpanExporter,
) -> None:
    store = MemoryStore()
    retried = await run(fails_first, store, [{}], n=2, config=RolloutConfig(max_attempts=2))
    failed = await run(fails_first, store, [{"always_fail": True}], config=RolloutConfig(max_attempts=1))
    spans = finished(exported)
    roots = by_name(spans, "agentloop.rollout")
    assert [
        r.attributes and r.attributes["agentloop.rollout.id"] for r in roots
    ] == retried + failed  # once each

    root = roots[0]
    first, second = [
        s for s in by_name(spans, "agentloop.attempt") if s.context.trace_id == root.context.trace_id
    ]
    assert parent_id(first) == parent_id(second) == root.context.span_id
    assert [s.attributes and s.attributes["agentloop.attempt.sequence_id"] for s in (first, second)] == [1, 2]
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "ValueError"  # the type only: messages with capture_content
    assert first.attributes and first.attributes["error.type"] == "ValueError"
    [exc] = [e for e in first.events if e.name == "exception"]
    assert exc.attributes and exc.attributes["exception.type"] == "ValueError"
    assert "exception.message" not in exc.attributes  # messages and tracebacks only with capture_content
    assert "exception.stacktrace" not in exc.attributes
    assert second.status.status_code is StatusCode.OK and root.status.status_code is StatusCode.OK
    assert root.attributes and root.attributes["agentloop.rollout.attempts"] == 2
    assert first.end_time <= second.start_time  # type: ignore[operator]

    attempts = await store.list_attempts(retried[0])
    # only the last attempt's runner exports (each rollout once); called by hand, it exports again
    assert not await tracing.export_rollout(store, retried[0], attempt_id=attempts[0].attempt_id)
    assert await tracing.export_rollout(store, retried[0], attempt_id=attempts[1].attempt_id)
    assert len(by_name(finished(exported), "agentloop.rollout")) == 3

    failed_root = roots[1]
    assert failed_root.status.status_code is StatusCode.ERROR
    assert failed_root.status.description == "ValueError"
    assert failed_root.attributes and failed_root.attributes["agentloop.rollout.status"] == "failed"


@rollout
async def quotes_its_task(task: dict[str, Any], llm: LLM | None) -> float:
    raise ValueError(f"could not parse {task['secret']!r}")  # what real exceptions do: quote the input


def everything_exported(spans: Sequence[ReadableSpan]) -> str:
    """Every name, attribute, event and status text of the spans, as one string."""
    parts: list[str] = []
    for s in spans:
        parts += [s.name, repr(dict(s.attributes or {})), str(s.status.description)]
        parts += [f"{e.name} {dict(e.attributes or {})!r}" for e in s.events]
    return "\n".join(parts)


@pytest.mark.parametrize("capture", [False, True])
async def test_an_exception_message_that_quotes_the_task_is_exported_only_with_capture_content(
    capture: bool,
) -> None:
    """Issue 44 finding 8: with content capture off the exception message (which carried the task
    text) still went out in the exception event and both ERROR statuses; now only its type does."""
    memory = InMemorySpanExporter()
    tracing.configure(exporter=memory, capture_content=capture)
    secret = "customer 4417: the password is hunter2"
    await run(quotes_its_task, MemoryStore(), [{"secret": secret}], config=RolloutConfig(max_attempts=1))
    spans = finished(memory)
    text = everything_exported(spans)
    assert ("hunter2" in text) is capture, text
    [attempt] = by_name(spans, "agentloop.attempt")
    [exc] = [e for e in attempt.events if e.name == "exception"]
    assert exc.attributes and exc.attributes["exception.type"] == "ValueError"
    assert attempt.status.description == (
        f"ValueError: could not parse {secret!r}" if capture else "ValueError"
    )


# ---------------------------------------------------------------- faults never reach the rollouts


@rollout
async def constant(task: dict[str, Any], llm: LLM | None) -> float:
    return 1.0


class RaisingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise ConnectionError("collector unreachable")


class BlockedExporter(SpanExporter):
    """Hangs in export until released (a collector that never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS


@pytest.mark.parametrize("how", ["batch", "simple"])
async def test_an_exporter_that_raises_does_not_break_the_run(how: str) -> None:
    exporter = RaisingExporter()
    if how == "batch":
        tracing.configure(exporter=exporter)
    else:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing.configure(provider)
    store = MemoryStore()
    ids = await run(constant, store, [{}] * 3)
    tracing.force_flush(timeout_s=10)
    assert exporter.calls >= 1
    assert [(await store.get_rollout(rid)).status.value for rid in ids] == ["succeeded"] * 3


async def test_a_hung_exporter_does_not_stall_rollouts() -> None:
    exporter = BlockedExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exports inline: the worst case
    tracing.configure(provider)
    store = MemoryStore()
    try:
        started = time.monotonic()
        ids = await run(constant, store, [{}] * 6)
        assert time.monotonic() - started < 10
        assert exporter.entered.wait(10)  # the span thread is stuck in export meanwhile
        assert [(await store.get_rollout(rid)).status.value for rid in ids] == ["succeeded"] * 6
        assert not tracing.force_flush(timeout_s=0.2)  # says it could not finish
    finally:
        exporter.release.set()


async def test_a_broken_tracer_is_logged_not_raised() -> None:
    class Broken(TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            tracer = super().get_tracer(*args, **kwargs)

            def start_span(*a: Any, **k: Any) -> Any:
                raise RuntimeError("tracer exploded")

            tracer.start_span = start_span  # type: ignore[method-assign]
            return tracer

    tracing.configure(Broken())
    store = MemoryStore()
    ids = await run(constant, store, [{}] * 2)
    assert tracing.force_flush(timeout_s=10)
    assert [(await store.get_rollout(rid)).status.value for rid in ids] == ["succeeded"] * 2


_HUNG_EXIT = """
import sys, threading, time
from opentelemetry.sdk.trace.export import SpanExporter
from agentloop import tracing

class Hung(SpanExporter):
    def export(self, spans):
        threading.Event().wait()  # a collector that never answers

    def shutdown(self):
        threading.Event().wait()

tracing.configure(exporter=Hung())
tracer = tracing._pipeline.tracer
for _ in range(3):
    tracer.start_span("x").end()
started = time.monotonic()
tracing.shutdown(timeout_s=2)
print("SHUTDOWN", round(time.monotonic() - started, 2), file=sys.stderr, flush=True)
"""


def test_a_hung_exporter_neither_blocks_shutdown_past_its_timeout_nor_the_exit() -> None:
    """Issue 44 finding 9: ``shutdown(timeout_s=2)`` waited forever on a hung exporter (the SDK's
    force_flush exports inline; its shutdown joins the export), and so did the process's exit."""
    started = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HUNG_EXIT],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the process did not exit within 30 s: {exc.stderr!r}") from None
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("SHUTDOWN")]
    assert float(line.split()[1]) < 2.5, line  # the timeout, held
    assert "tracing_gave_up" in out.stdout + out.stderr  # and it said so
    assert time.monotonic() - started < 30


def test_configure_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="a tracer_provider or an exporter, not both"):
        tracing.configure(TracerProvider(), exporter=InMemorySpanExporter())
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
        tracing.configure(timeout_s=0)
    with pytest.raises(TypeError, match="must be an opentelemetry TracerProvider"):
        tracing.configure("jaeger")  # type: ignore[arg-type]
    assert not tracing.enabled()


# ---------------------------------------------------------------- off by default; the OTEL_* variables

_RUN = """
import os, sys, threading, anyio
import agentloop
from agentloop import tracing
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from tests.runner_fixtures import echo_agent

reads = []

class Store(MemoryStore):
    async def list_attempts(self, rollout_id):
        reads.append(rollout_id)
        return await super().list_attempts(rollout_id)

async def main():
    store = Store()
    for _ in range(3):
        await store.enqueue_rollout({"reward": 1.0})
    stats = await Runner(echo_agent, store, poll_interval=0.01).run(max_rollouts=3)
    assert stats.succeeded == 3, stats

anyio.run(main)
if not os.environ.get("SKIP_SHUTDOWN"):  # else the exit hook flushes
    tracing.shutdown()
threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("agentloop-tracing"))
print("RESULT", len(reads), any(m.startswith("opentelemetry") for m in sys.modules), threads, file=sys.stderr)
"""


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", _RUN],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_off_by_default_nothing_is_imported_read_or_started() -> None:
    out = run_script({})
    assert "RESULT 0 False []" in out.stderr  # no store reads, no opentelemetry module, no thread


def test_the_standard_variables_turn_it_on() -> None:
    variables = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "calc-agents"}
    out = run_script({**variables, "SKIP_SHUTDOWN": "1"})  # no shutdown(): the exit hook flushes
    assert "RESULT 3 True" in out.stderr
    assert out.stdout.count('"name": "agentloop.rollout"') == 3
    assert out.stdout.count('"service.name": "calc-agents"') == 6  # 3 rollouts + 3 attempts


def test_an_unknown_exporter_name_is_a_warning_not_a_crash() -> None:
    out = run_script({"OTEL_TRACES_EXPORTER": "nosuchexporter"})
    assert "RESULT 0 True []" in out.stderr  # looked for it, stayed off, the rollouts ran
    logged = out.stdout + out.stderr
    assert "tracing_not_configured" in logged and "nosuchexporter" in logged
