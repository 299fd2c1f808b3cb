"""The one state machine of rollouts and attempts, shared by every store backend.

Pure functions over the pydantic models of :mod:`agentloop.types`: each takes the current
objects and the time (``now``, from the store's injectable clock) and returns *new* objects;
nothing here touches storage. A backend loads the rows, calls one of these, and saves what
comes back in one transaction.

Rollout lifecycle::

    queued ──► running ──► succeeded
      │          │  ├────► failed
      │          │  └────► requeued ──► running ...   (back of the queue)
      └──────────┴──────► cancelled  (from any non-terminal state)

Attempt lifecycle::

    preparing ──► running ──► succeeded | failed | timeout | unresponsive
        └────────────────────► (any terminal status)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from agentloop.errors import InvalidRequestError, InvalidTransitionError, StaleAttemptError
from agentloop.resources import LLM, ProxyLLM, Resource, Resources
from agentloop.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ErrorInfo,
    Reward,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    Span,
    check_json,
)

Clock = Callable[[], float]  # returns seconds since the epoch, like time.time

R, A = RolloutStatus, AttemptStatus

ROLLOUT_TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    R.QUEUED: frozenset({R.RUNNING, R.CANCELLED}),
    R.RUNNING: frozenset({R.SUCCEEDED, R.FAILED, R.REQUEUED, R.CANCELLED}),
    R.REQUEUED: frozenset({R.RUNNING, R.CANCELLED}),
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.CANCELLED: frozenset(),
}

_ATTEMPT_ENDS = frozenset({A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE})
ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    A.PREPARING: frozenset({A.RUNNING}) | _ATTEMPT_ENDS,
    A.RUNNING: _ATTEMPT_ENDS,
    **{s: frozenset() for s in _ATTEMPT_ENDS},
}

TERMINAL_ROLLOUT = frozenset({R.SUCCEEDED, R.FAILED, R.CANCELLED})
ACTIVE_ATTEMPT = frozenset({A.PREPARING, A.RUNNING})


# ---------------------------------------------------------------- input checks


def require_id(field: str, value: Any) -> str:
    """A non-empty string id, or InvalidRequestError naming the field and what came."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"{field} must be a non-empty string, got {type(value).__name__} {value!r:.80}"
        )
    return value


def require_timeout(value: Any) -> float:
    """A finite or infinite number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise InvalidRequestError(f"timeout must be a number of seconds >= 0, got {value!r:.80}")
    return float(value)


def require_json(field: str, value: Any) -> None:
    """Reject values that cannot travel as JSON (every backend stores JSON, never pickle): NaN and
    Infinity, nesting deeper than MAX_JSON_DEPTH (checked first, so deep input never recurses)."""
    try:
        check_json(field, value)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{field} must be JSON-serialisable: {exc}") from None


def parse_attempt_status(value: Any) -> AttemptStatus | None:
    if value is None or isinstance(value, AttemptStatus):
        return value
    try:
        return AttemptStatus(value)
    except ValueError:
        allowed = [s.value for s in AttemptStatus]
        raise InvalidRequestError(f"status must be one of {allowed}, got {value!r:.80}") from None


def parse_config(config: Any) -> RolloutConfig:
    """A RolloutConfig from None, a RolloutConfig or a dict (pydantic ValidationError names the field)."""
    if config is None:
        return RolloutConfig.model_validate({})
    if isinstance(config, RolloutConfig):
        return config
    if isinstance(config, dict):
        return RolloutConfig.model_validate(config)
    raise InvalidRequestError(f"config must be a RolloutConfig or dict, got {type(config).__name__}")


def new_rollout(input: Any, mode: Any, config: Any, metadata: Any, now: float) -> Rollout:
    """Validate the arguments of ``enqueue_rollout`` and build the queued rollout."""
    if mode not in ("train", "val", "test"):
        raise InvalidRequestError(f"mode must be 'train', 'val' or 'test', got {mode!r:.80}")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequestError(f"metadata must be a dict or None, got {type(metadata).__name__}")
    require_json("input", input)
    require_json("metadata", metadata)
    fields = {"input": input, "mode": mode, "metadata": metadata or {}, "enqueue_time": now}
    return Rollout.model_validate({**fields, "config": parse_config(config)})


# ---------------------------------------------------------------- transitions


def check_rollout_transition(rollout: Rollout, new: RolloutStatus) -> None:
    if new not in ROLLOUT_TRANSITIONS[rollout.status]:
        raise InvalidTransitionError(
            f"rollout {rollout.rollout_id} cannot go from {rollout.status.value} to {new.value}"
        )


def check_attempt_transition(attempt: Attempt, new: AttemptStatus) -> None:
    if new not in ATTEMPT_TRANSITIONS[attempt.status]:
        raise InvalidTransitionError(
            f"attempt {attempt.attempt_id} of rollout {attempt.rollout_id} cannot go from "
            f"{attempt.status.value} to {new.value}"
        )


def ensure_current(rollout: Rollout, attempt: Attempt, latest_attempt_id: str | None) -> None:
    """Writes (spans, heartbeats, status) are accepted only from the latest, unfinished attempt."""
    if attempt.attempt_id != latest_attempt_id:
        raise StaleAttemptError(
            f"attempt {attempt.attempt_id} (#{attempt.sequence_id}) of rollout {rollout.rollout_id} is stale: "
            f"a newer attempt {latest_attempt_id} superseded it; stop writing for this attempt"
        )
    if attempt.status.is_terminal:
        raise StaleAttemptError(
            f"attempt {attempt.attempt_id} of rollout {rollout.rollout_id} already finished as "
            f"{attempt.status.value}; it takes no more writes"
        )
    if rollout.status.is_terminal:
        raise StaleAttemptError(
            f"rollout {rollout.rollout_id} is already {rollout.status.value}; attempt {attempt.attempt_id} "
            "takes no more writes"
        )


def start_attempt(
    rollout: Rollout, worker_id: str | None, resources: Resources | None, now: float
) -> tuple[Rollout, Attempt, AttemptedRollout]:
    """Dequeue: the rollout runs its attempt n+1 (status preparing) with the latest resources."""
    check_rollout_transition(rollout, R.RUNNING)
    seq = rollout.num_attempts + 1
    attempt = Attempt(
        rollout_id=rollout.rollout_id,
        sequence_id=seq,
        worker_id=worker_id,
        start_time=now,
        last_heartbeat_time=now,
    )
    version = resources.version if resources is not None else None
    updated = rollout.model_copy(
        update={
            "status": R.RUNNING,
            "num_attempts": seq,
            "resources_version": version,
            "start_time": rollout.start_time if rollout.start_time is not None else now,
        }
    )
    attempted = AttemptedRollout.model_construct(
        **{name: getattr(updated, name) for name in Rollout.model_fields},
        attempt=attempt.model_copy(),
        resources=resources.model_copy() if resources is not None else None,
    )
    return updated, attempt, attempted


def finish_attempt(
    rollout: Rollout, attempt: Attempt, status: AttemptStatus, error: ErrorInfo | None, now: float
) -> tuple[Rollout, Attempt]:
    """A terminal attempt status and what it does to the rollout.

    succeeded -> succeeded; a status in ``config.retry_on`` with attempts left -> requeued (the
    caller puts it at the back of the queue); anything else -> failed.
    """
    check_attempt_transition(attempt, status)
    if not status.is_terminal:
        raise InvalidTransitionError(f"finish_attempt needs a terminal status, got {status.value}")
    attempt = attempt.model_copy(update={"status": status, "end_time": now, "error": error or attempt.error})
    cfg = rollout.config
    if status is A.SUCCEEDED:
        new = R.SUCCEEDED
    elif status in cfg.retry_on and rollout.num_attempts < cfg.max_attempts:
        new = R.REQUEUED
    else:
        new = R.FAILED
    check_rollout_transition(rollout, new)
    end = now if new in TERMINAL_ROLLOUT else None
    return rollout.model_copy(update={"status": new, "end_time": end}), attempt


def update_attempt(
    rollout: Rollout,
    attempt: Attempt,
    latest_attempt_id: str | None,
    status: AttemptStatus | None,
    error: ErrorInfo | None,
    heartbeat: bool,
    now: float,
) -> tuple[Rollout, Attempt]:
    """``Store.update_attempt``: heartbeat, preparing -> running, or a terminal status."""
    ensure_current(rollout, attempt, latest_attempt_id)
    if heartbeat or status is not None:
        attempt = attempt.model_copy(update={"last_heartbeat_time": now})
    if error is not None and status is None:
        attempt = attempt.model_copy(update={"error": error})
    if status is None or status is attempt.status:
        return rollout, attempt
    if status.is_terminal:
        return finish_attempt(rollout, attempt, status, error, now)
    check_attempt_transition(attempt, status)
    return rollout, attempt.model_copy(update={"status": status})


def accept_span(
    rollout: Rollout,
    attempt: Attempt,
    latest_attempt_id: str | None,
    span: Span,
    next_sequence_id: int,
    now: float,
) -> tuple[Attempt, Span]:
    """``Store.add_span``: check the attempt is current, number the span, heartbeat, maybe start running.

    One write after the end is allowed: a Reward span on the latest attempt of a succeeded rollout (a
    score computed once the attempt finished, such as an LLM judge's over the attempts at one task,
    agentloop/judge/); it changes nothing else on the attempt."""
    if span.rollout_id != rollout.rollout_id:
        raise InvalidRequestError(
            f"span.rollout_id {span.rollout_id} does not match rollout {rollout.rollout_id}"
        )
    late_reward = (
        isinstance(span.payload, Reward)
        and rollout.status is R.SUCCEEDED
        and attempt.status is A.SUCCEEDED
        and attempt.attempt_id == latest_attempt_id
    )
    if not late_reward:
        ensure_current(rollout, attempt, latest_attempt_id)
    update: dict[str, Any] = {} if late_reward else {"last_heartbeat_time": now}
    if attempt.status is A.PREPARING:
        update["status"] = A.RUNNING
    if span.sequence_id is None:
        span = span.model_copy(update={"sequence_id": next_sequence_id})
    elif span.sequence_id < next_sequence_id:
        raise InvalidRequestError(
            f"span sequence_id {span.sequence_id} of attempt {attempt.attempt_id} is already used; "
            f"the next free one is {next_sequence_id} (leave sequence_id None to get it)"
        )
    return attempt.model_copy(update=update), span


def cancel(rollout: Rollout, attempt: Attempt | None, now: float) -> tuple[Rollout, Attempt | None]:
    """Cancel a non-terminal rollout; its active attempt (if any) ends as failed."""
    check_rollout_transition(rollout, R.CANCELLED)
    if attempt is not None and attempt.status in ACTIVE_ATTEMPT:
        err = ErrorInfo(type="Cancelled", message=f"rollout {rollout.rollout_id} was cancelled")
        attempt = attempt.model_copy(update={"status": A.FAILED, "end_time": now, "error": err})
    return rollout.model_copy(update={"status": R.CANCELLED, "end_time": now}), attempt


# ---------------------------------------------------------------- watchdog


def attempt_deadline(attempt: Attempt, config: RolloutConfig) -> float | None:
    """The earliest time at which the watchdog would end this attempt; None if never."""
    if attempt.status not in ACTIVE_ATTEMPT:
        return None
    times = []
    if config.timeout_s is not None:
        times.append(attempt.start_time + config.timeout_s)
    if config.unresponsive_s is not None:
        times.append(attempt.last_heartbeat_time + config.unresponsive_s)
    return min(times) if times else None


def watchdog_verdict(attempt: Attempt, config: RolloutConfig, now: float) -> AttemptStatus | None:
    """timeout when ``now - start_time > timeout_s``; unresponsive when ``now - last_heartbeat_time >
    unresponsive_s``; None while the attempt is fine (or already finished). Timeout wins a tie."""
    if attempt.status not in ACTIVE_ATTEMPT:
        return None
    if config.timeout_s is not None and now - attempt.start_time > config.timeout_s:
        return A.TIMEOUT
    if config.unresponsive_s is not None and now - attempt.last_heartbeat_time > config.unresponsive_s:
        return A.UNRESPONSIVE
    return None


def watchdog_error(attempt: Attempt, config: RolloutConfig, verdict: AttemptStatus, now: float) -> ErrorInfo:
    if verdict is A.TIMEOUT:
        msg = f"attempt ran {now - attempt.start_time:.3f}s, over timeout_s={config.timeout_s}"
        return ErrorInfo(type="Timeout", message=msg)
    msg = f"no heartbeat for {now - attempt.last_heartbeat_time:.3f}s, over unresponsive_s={config.unresponsive_s}"
    return ErrorInfo(type="Unresponsive", message=msg)


def run_watchdog(rollout: Rollout, attempt: Attempt, now: float) -> tuple[Rollout, Attempt] | None:
    """End the attempt as timeout/unresponsive when it is overdue; None when nothing changes."""
    if rollout.status.is_terminal:
        return None
    verdict = watchdog_verdict(attempt, rollout.config, now)
    if verdict is None:
        return None
    return finish_attempt(
        rollout, attempt, verdict, watchdog_error(attempt, rollout.config, verdict, now), now
    )


# ------------------------------------------------------------ input shared by the backends
# (each call's arguments checked the same way in memory, SQLite and over HTTP)


def parse_ids(rollout_ids: Any) -> list[str]:
    if isinstance(rollout_ids, str) or not isinstance(rollout_ids, list | tuple):
        raise InvalidRequestError(f"rollout_ids must be a list of ids, got {type(rollout_ids).__name__}")
    return list(dict.fromkeys(require_id("rollout_ids[]", rid) for rid in rollout_ids))


def parse_statuses(status: Any) -> set[RolloutStatus] | None:
    if status is None:
        return None
    if isinstance(status, str) or not isinstance(status, list | tuple | set):
        raise InvalidRequestError(f"status must be a list of rollout statuses, got {type(status).__name__}")
    try:
        return {RolloutStatus(s) for s in status}
    except ValueError:
        allowed = [s.value for s in RolloutStatus]
        raise InvalidRequestError(
            f"status entries must be among {allowed}, got {list(status)!r:.120}"
        ) from None


def parse_limit(limit: Any) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidRequestError(f"limit must be an int >= 0 or None, got {limit!r:.80}")
    return limit


_RESOURCES_SHAPE = (
    "a Resources, or a mapping of names to resources such as "
    "{'main_llm': LLM(base_url='http://host/v1', model='m')} (LLM or ProxyLLM values)"
)
_RESOURCE = TypeAdapter(Resource)


def _is_resource(value: Any) -> bool:
    return isinstance(value, LLM | ProxyLLM) or (isinstance(value, Mapping) and "resource_type" in value)


def _resource_problem(value: Any, exc: ValidationError) -> str:
    if not isinstance(value, Mapping):
        return f"got {type(value).__name__}: {value!r:.80}"
    error = exc.errors()[0]
    if error["type"] == "union_tag_not_found":
        return f"the dict has no resource_type (keys: {sorted(map(str, value))})"
    field = ".".join(str(part) for part in error["loc"][1:])  # loc[0] is the resource_type tag
    return f"{field}: {error['msg']}" if field else str(error["msg"])


def parse_resources(resources: Any) -> Resources:
    """``resources`` as a Resources: given as one; as a mapping of names to LLM / ProxyLLM (or their dicts,
    ``resource_type`` included), as Agent Lightning's ``add_resources({"main_llm": LLM(...)})``; or as a
    Resources-shaped dict (``{"items": {...}}``, what JSON gives). Anything else is an InvalidRequestError
    that shows the expected shape."""
    if isinstance(resources, Resources):
        return resources
    if not isinstance(resources, Mapping):
        raise InvalidRequestError(
            f"resources must be {_RESOURCES_SHAPE}; got {type(resources).__name__}: {resources!r:.80}"
        )
    if not all(_is_resource(v) for v in resources.values()) and set(resources) <= set(Resources.model_fields):
        return Resources.model_validate(dict(resources))  # {"items": {...}, "version": ...}
    items: dict[str, LLM | ProxyLLM] = {}
    for name, value in resources.items():
        if not isinstance(name, str):
            raise InvalidRequestError(
                f"resources must be {_RESOURCES_SHAPE}; got the key {name!r:.80} ({type(name).__name__})"
            )
        try:
            items[name] = _RESOURCE.validate_python(value)
        except ValidationError as exc:
            problem = _resource_problem(value, exc)
            raise InvalidRequestError(
                f"resources[{name!r}] must be an LLM or ProxyLLM (or a dict with resource_type 'llm' or "
                f"'proxy_llm'): {problem}; resources must be {_RESOURCES_SHAPE}"
            ) from None
    return Resources(items=items)


def parse_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidRequestError(f"version must be an int, got {version!r:.80}")
    return version


def parse_span(span: Any) -> Span:
    if isinstance(span, Span):
        return span
    if isinstance(span, dict):
        return Span.model_validate(span)
    raise InvalidRequestError(f"span must be a Span or dict, got {type(span).__name__}")


def parse_error(error: Any) -> ErrorInfo | None:
    if error is None or isinstance(error, ErrorInfo):
        return error
    if isinstance(error, dict):
        return ErrorInfo.model_validate(error)
    raise InvalidRequestError(f"error must be an ErrorInfo, dict or None, got {type(error).__name__}")
