"""The spans of one finished rollout, made from what the store recorded (runs on the span thread).

Names and attributes (GenAI semantic conventions where they have one, ``agentloop.*`` otherwise):

- ``agentloop.rollout``: ``agentloop.rollout.id`` / ``.mode`` / ``.status`` / ``.attempts``,
  ``agentloop.resources.version``, ``agentloop.reward`` (the last attempt's); status OK when succeeded,
  ERROR (the last attempt's error type) when failed.
- ``agentloop.attempt``: ``gen_ai.operation.name=invoke_agent``, ``gen_ai.agent.name``,
  ``agentloop.attempt.id`` / ``.sequence_id`` / ``.status``, ``agentloop.worker.id``, ``agentloop.reward``
  (the sum of its Reward spans); events ``agentloop.reward`` and ``agentloop.log`` at their times; a
  failed, timed-out or unresponsive attempt: ERROR status, ``error.type`` and an ``exception`` event
  (the exception type only: its message, like its traceback, only with ``capture_content``).
- ``chat <model>`` (``text_completion`` for /v1/completions), kind CLIENT: ``gen_ai.operation.name``,
  ``gen_ai.provider.name=agentloop``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` /
  ``output_tokens`` (len of the recorded prompt / response ids), ``gen_ai.response.finish_reasons``,
  ``gen_ai.request.temperature`` / ``top_p`` / ``top_k`` / ``max_tokens`` / ``seed`` / ``stop_sequences``,
  ``agentloop.weights_version``, ``agentloop.ledger_break``, ``agentloop.call.id`` /
  ``.parent_id`` / ``.branch`` (the call tree as recorded; None values left out); ``error.type`` when
  the call failed.
- ``execute_tool <name>``: ``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.type``;
  ``error.type`` and ERROR when the tool failed.

Times: LLM call and tool spans end at their span's timestamp and start ``latency_s`` earlier.
With ``capture_content``: ``gen_ai.input.messages`` / ``gen_ai.output.messages`` /
``gen_ai.tool.definitions`` (the OpenAI-format messages and tools as JSON), ``gen_ai.tool.call.arguments``
/ ``.result``, ``agentloop.rollout.input``, log fields, ``exception.message`` (and the message in the ERROR status
descriptions) and ``exception.stacktrace``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentloop.types import (
    Attempt,
    AttemptStatus,
    LLMCall,
    Log,
    Reward,
    Rollout,
    RolloutStatus,
    Span,
    ToolCall,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

_MAX_TEXT = 1000  # characters of an error message in a span status
_SAMPLING_ATTRS = {  # LLMCall.sampling key -> GenAI request attribute
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "stop": "gen_ai.request.stop_sequences",
}


@dataclass(frozen=True)
class Job:
    """One finished rollout, as the store holds it."""

    rollout: Rollout
    attempts: list[Attempt]
    spans: list[list[Span]]  # per attempt, in sequence order
    agent_name: str | None


def _ns(t: float) -> int:
    return int(t * 1e9)


def _attrs(**pairs: Any) -> dict[str, Any]:
    """``a__b_c=`` -> ``a.b_c``; None values are left out (OTel attributes have no null)."""
    return {k.replace("__", "."): v for k, v in pairs.items() if v is not None}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def emit(tracer: Tracer, job: Job, capture: bool) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    r = job.rollout
    ends = [a.end_time for a in job.attempts if a.end_time is not None]
    end = r.end_time or max(ends, default=None) or time.time()
    rewards = [_reward(spans) for spans in job.spans]
    root = tracer.start_span(
        "agentloop.rollout",
        kind=SpanKind.INTERNAL,
        start_time=_ns(r.enqueue_time),
        attributes=_attrs(
            agentloop__rollout__id=r.rollout_id,
            agentloop__rollout__mode=r.mode,
            agentloop__rollout__status=r.status.value,
            agentloop__rollout__attempts=len(job.attempts),
            agentloop__resources__version=r.resources_version,
            agentloop__reward=rewards[-1] if rewards else None,
            agentloop__rollout__input=_json(r.input) if capture else None,
        ),
    )
    parent = trace.set_span_in_context(root)
    for attempt, spans, reward in zip(job.attempts, job.spans, rewards, strict=True):
        _emit_attempt(tracer, parent, attempt, spans, reward, job.agent_name, capture)
    if r.status is RolloutStatus.SUCCEEDED:
        root.set_status(Status(StatusCode.OK))
    elif r.status is RolloutStatus.FAILED:
        last = job.attempts[-1].error if job.attempts else None
        root.set_status(
            Status(StatusCode.ERROR, _describe(last.type, last.message, capture) if last else "failed")
        )
    root.end(end_time=_ns(end))


def _reward(spans: list[Span]) -> float | None:
    """The attempt's return: the sum of its Reward spans (the adapter's ``identical`` strategy)."""
    values = [s.payload.value for s in spans if isinstance(s.payload, Reward)]
    return sum(values) if values else None


def _describe(kind: str, message: str, capture: bool) -> str:
    """The status text of a failure: the exception type, and its message only with capture_content
    (a message quotes what the agent was working on: the task, a tool's arguments, a model's reply)."""
    text = f"{kind}: {message}" if message and capture else kind
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


def _emit_attempt(
    tracer: Tracer,
    parent: Context,
    a: Attempt,
    spans: list[Span],
    reward: float | None,
    agent_name: str | None,
    capture: bool,
) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    end = a.end_time or max((s.timestamp for s in spans), default=a.start_time)
    span = tracer.start_span(
        "agentloop.attempt",
        context=parent,
        kind=SpanKind.INTERNAL,
        start_time=_ns(a.start_time),
        attributes=_attrs(
            gen_ai__operation__name="invoke_agent",
            gen_ai__agent__name=agent_name,
            agentloop__rollout__id=a.rollout_id,
            agentloop__attempt__id=a.attempt_id,
            agentloop__attempt__sequence_id=a.sequence_id,
            agentloop__attempt__status=a.status.value,
            agentloop__worker__id=a.worker_id,
            agentloop__reward=reward,
        ),
    )
    context = trace.set_span_in_context(span)
    for s in spans:
        p = s.payload
        if isinstance(p, LLMCall):
            _emit_llm_call(tracer, context, s, p, capture)
        elif isinstance(p, ToolCall):
            _emit_tool_call(tracer, context, s, p, capture)
        elif isinstance(p, Reward):
            span.add_event(
                "agentloop.reward",
                _attrs(agentloop__reward__value=p.value, agentloop__reward__name=p.name),
                timestamp=_ns(s.timestamp),
            )
        elif isinstance(p, Log):
            fields = _json(p.fields) if capture and p.fields else None
            span.add_event(
                "agentloop.log",
                _attrs(
                    agentloop__log__message=p.message,
                    agentloop__log__level=p.level,
                    agentloop__log__fields=fields,
                ),
                timestamp=_ns(s.timestamp),
            )
    if a.status is AttemptStatus.SUCCEEDED:
        span.set_status(Status(StatusCode.OK))
    elif a.status.is_terminal:
        err = a.error
        kind = err.type if err else a.status.value
        span.set_attribute("error.type", kind)
        span.add_event(
            "exception",
            _attrs(
                exception__type=kind,
                exception__message=err.message if err and capture else None,
                exception__stacktrace=err.traceback if err and capture else None,
            ),
            timestamp=_ns(end),
        )
        span.set_status(Status(StatusCode.ERROR, _describe(kind, err.message if err else "", capture)))
    span.end(end_time=_ns(end))


def _emit_llm_call(tracer: Tracer, parent: Context, s: Span, call: LLMCall, capture: bool) -> None:
    from opentelemetry.trace import SpanKind, Status, StatusCode

    operation = "chat" if call.messages else "text_completion"
    attrs = _attrs(
        gen_ai__operation__name=operation,
        gen_ai__provider__name="agentloop",
        gen_ai__request__model=call.model,
        gen_ai__usage__input_tokens=len(call.prompt_ids),
        gen_ai__usage__output_tokens=len(call.response_ids),
        gen_ai__response__finish_reasons=[call.finish_reason] if call.finish_reason else None,
        agentloop__weights_version=call.weights_version,
        agentloop__ledger_break=call.ledger_break,
        agentloop__tool_call_parse_error=call.tool_call_parse_error or None,
        agentloop__call__id=call.call_id,
        agentloop__call__parent_id=call.parent_call_id,
        agentloop__call__branch=call.branch,
    )
    for key, name in _SAMPLING_ATTRS.items():
        value = call.sampling.get(key)
        if key == "top_k" and value == 0:
            continue  # 0: top-k off, not "keep no token"
        if isinstance(value, str | int | float) or (isinstance(value, list) and value):
            attrs[name] = value
    if capture:
        attrs["gen_ai.input.messages"] = _json(call.messages) if call.messages else None
        attrs["gen_ai.output.messages"] = _json([call.response_message]) if call.response_message else None
        attrs["gen_ai.tool.definitions"] = _json(call.tools) if call.tools else None
        attrs = {k: v for k, v in attrs.items() if v is not None}
    start = s.timestamp - (call.latency_s or 0.0)
    span = tracer.start_span(
        f"{operation} {call.model}" if call.model else operation,
        context=parent,
        kind=SpanKind.CLIENT,
        start_time=_ns(start),
        attributes=attrs,
    )
    if call.error:
        span.set_attribute("error.type", call.error)
        span.set_status(Status(StatusCode.ERROR, call.error))
    span.end(end_time=_ns(s.timestamp))


def _emit_tool_call(tracer: Tracer, parent: Context, s: Span, call: ToolCall, capture: bool) -> None:
    from opentelemetry.trace import SpanKind, Status, StatusCode

    attrs = _attrs(
        gen_ai__operation__name="execute_tool", gen_ai__tool__name=call.name, gen_ai__tool__type="function"
    )
    if capture:
        attrs["gen_ai.tool.call.arguments"] = _json(call.arguments)
        attrs["gen_ai.tool.call.result"] = _json(call.result)
    span = tracer.start_span(
        f"execute_tool {call.name}",
        context=parent,
        kind=SpanKind.INTERNAL,
        start_time=_ns(s.timestamp - (call.latency_s or 0.0)),
        attributes=attrs,
    )
    if call.error:
        span.set_attribute("error.type", call.error)
        span.set_status(Status(StatusCode.ERROR, call.error))
    span.end(end_time=_ns(s.timestamp))
