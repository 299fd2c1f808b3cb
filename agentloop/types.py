"""The data model: rollouts, attempts, spans, LLM calls and training triplets.

Every model is pydantic v2; a wrong type raises ``pydantic.ValidationError`` naming the field.
Lifecycles are ordered enums and the legal transitions live in :mod:`agentloop.store.state`.
"""

from __future__ import annotations

import math
import secrets
import time
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from agentloop.resources import Resources

JSON = Any  # a JSON-serialisable value
# deepest nesting of one JSON field: real messages, tool schemas and metadata stay far below; the JSON
# parsers that read stored spans back stop at 200 levels (pydantic) and 255 (orjson) for a whole document
MAX_JSON_DEPTH = 100
# largest |reward| a Reward span holds: a sum of rewards stays far from float overflow (two 1.7e308
# rewards summed to inf and killed the online trainer); tasks score in [-1, 1] or a few hundred at most
MAX_ABS_REWARD = 1e6


def new_rollout_id() -> str:
    """An unguessable rollout id (128 random bits)."""
    return "ro-" + secrets.token_hex(16)


def new_attempt_id() -> str:
    """An unguessable attempt id (128 random bits)."""
    return "at-" + secrets.token_hex(16)


_SCALARS = (str, int, bool, type(None))  # exact types that need no look (bool is an int, kept for clarity)


def check_json(field: str, value: Any) -> Any:
    """``value`` unchanged, or ValueError naming ``field``: a float that is NaN or infinite (JSON has no
    such numbers: stored as null, they broke every later read), or nesting deeper than MAX_JSON_DEPTH.

    Iterative, so hostile nesting cannot exhaust the Python stack; only containers are stacked and
    strings/ints are skipped by exact type (a 40-message conversation costs tens of microseconds)."""
    stack: list[tuple[Any, int]] = [([value], -1)]
    while stack:
        container, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(
                f"{field} is nested deeper than {MAX_JSON_DEPTH} levels; flatten it or store it as a string"
            )
        for item in container.values() if type(container) is dict else container:
            if type(item) in _SCALARS:
                continue
            if isinstance(item, float):
                if not math.isfinite(item):
                    raise ValueError(f"{field} must hold finite numbers only, got {item} (NaN/Infinity)")
            elif isinstance(item, dict):
                stack.append((item, depth + 1))
            elif isinstance(item, list | tuple):
                stack.append((item, depth + 1))
    return value


class _Model(BaseModel):
    # allow_inf_nan=False: NaN/Infinity in any float field (rewards, log-probs, times) is a ValidationError
    # naming the field, never a value stored as null that breaks every later read
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _json_field(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A field validator for JSON (Any) fields: check_json under the field's name."""
    return check_json(info.field_name or "value", value)


# ---------------------------------------------------------------- lifecycles


class RolloutStatus(StrEnum):
    QUEUED = "queued"  # waiting in the FIFO queue for its first attempt
    RUNNING = "running"  # an attempt has been dequeued and has not finished
    REQUEUED = "requeued"  # the last attempt failed and may be retried; back of the queue
    SUCCEEDED = "succeeded"  # terminal: an attempt succeeded
    FAILED = "failed"  # terminal: attempts exhausted or the failure is not retried
    CANCELLED = "cancelled"  # terminal: cancelled by the user

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_ROLLOUT


class AttemptStatus(StrEnum):
    PREPARING = "preparing"  # dequeued; the agent has not produced a span yet
    RUNNING = "running"  # the first span (heartbeat) arrived
    SUCCEEDED = "succeeded"  # terminal: the agent returned normally
    FAILED = "failed"  # terminal: the agent raised or broke its contract
    TIMEOUT = "timeout"  # terminal: older than RolloutConfig.timeout_s
    UNRESPONSIVE = "unresponsive"  # terminal: no heartbeat for RolloutConfig.unresponsive_s

    @property
    def is_terminal(self) -> bool:
        return self not in (AttemptStatus.PREPARING, AttemptStatus.RUNNING)


_TERMINAL_ROLLOUT = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED})

RolloutMode = Literal["train", "val", "test"]


class RolloutConfig(_Model):
    """How long an attempt may take and when a rollout is retried."""

    timeout_s: float | None = Field(
        default=None, gt=0, description="Wall time one attempt may take; None: no limit."
    )
    unresponsive_s: float | None = Field(
        default=None,
        gt=0,
        description="Silence (no span or heartbeat) after which an attempt is unresponsive.",
    )
    max_attempts: int = Field(default=1, ge=1, description="Attempts per rollout, the first one included.")
    retry_on: set[AttemptStatus] = Field(
        default_factory=lambda: {AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE},
        description="Terminal attempt statuses that requeue the rollout while attempts remain.",
    )

    @field_validator("retry_on")
    @classmethod
    def _only_terminal(cls, value: set[AttemptStatus]) -> set[AttemptStatus]:
        bad = sorted(s.value for s in value if not s.is_terminal or s is AttemptStatus.SUCCEEDED)
        if bad:
            raise ValueError(f"retry_on takes failed / timeout / unresponsive, got {bad}")
        return value


class ErrorInfo(_Model):
    """An exception recorded on an attempt."""

    type: str
    message: str
    traceback: str | None = None


class Attempt(_Model):
    """One try at running a rollout."""

    rollout_id: str
    attempt_id: str = Field(default_factory=new_attempt_id)
    sequence_id: int = Field(default=1, ge=1, description="1 for the first attempt, +1 per retry.")
    worker_id: str | None = None
    status: AttemptStatus = AttemptStatus.PREPARING
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    last_heartbeat_time: float = Field(default_factory=time.time)
    error: ErrorInfo | None = None


class Rollout(_Model):
    """One task to run through an agent, with its lifecycle."""

    rollout_id: str = Field(default_factory=new_rollout_id)
    input: JSON = Field(
        description="The task. A dict's 'reference' field (the answer, a hidden test) is for trainer-side "
        "scorers: a StoreServer never shows it to a runner key (agentloop/store/server.py)."
    )
    mode: RolloutMode = "train"
    status: RolloutStatus = RolloutStatus.QUEUED
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    resources_version: int | None = Field(
        default=None, description="Resources version the latest attempt ran with."
    )
    enqueue_time: float = Field(default_factory=time.time)
    start_time: float | None = None
    end_time: float | None = None
    num_attempts: int = 0
    metadata: dict[str, JSON] = Field(default_factory=dict)

    check_json_fields = field_validator("input", "metadata")(_json_field)


class AttemptedRollout(Rollout):
    """What a worker gets from ``dequeue_rollout``: the rollout, its new attempt and the resources."""

    attempt: Attempt
    resources: Resources | None = None


# ---------------------------------------------------------------- spans

# The conversation a call belongs to inside its attempt (rules: agentloop/adapter.py's docstring):
Branch = Literal[
    "main",  # the attempt's main conversation: its main root and every call that extends it
    "subagent",  # a later conversation of its own (another system prompt, tools or several calls)
    "compaction",  # the main conversation restated (a summary, a rewritten history) and continued
    "side",  # a call beside the conversation: a title, a summary, a quota check (no tools)
]
BRANCHES: tuple[str, ...] = get_args(Branch)


class LLMCall(_Model):
    """One request to the model: the exact token ids it saw and produced."""

    kind: Literal["llm_call"] = "llm_call"
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = Field(
        default=None,
        description="The sampling policy's log-prob of each sampled token: log_softmax(logits / T), "
        "raw logits when T = 0, top-p/top-k not renormalised (engine/base.py).",
    )
    messages: list[dict[str, JSON]] = Field(default_factory=list)
    tools: list[dict[str, JSON]] | None = None
    response_message: dict[str, JSON] | None = None
    finish_reason: str | None = None
    sampling: dict[str, JSON] = Field(default_factory=dict)
    latency_s: float | None = None
    weights_version: int | None = None
    response_versions: list[int] | None = Field(
        default=None,
        description="The weights version that sampled each response token, when they differ "
        "(an engine with weight_update_policy='inflight'); None: all are weights_version's.",
    )
    model: str | None = None
    error: str | None = Field(
        default=None, description="e.g. 'context_length_exceeded'; no tokens to train on."
    )
    ledger_break: str | None = Field(
        default=None, description="Why delta tokenization fell back to a full render."
    )
    tool_call_parse_error: bool = False
    call_id: int | None = Field(
        default=None,
        ge=1,
        description="The call's number in its attempt or session, from 1 (the token ledger's); "
        "None: recorded before calls had ids.",
    )
    parent_call_id: int | None = Field(
        default=None,
        ge=1,
        description="The call whose prompt + response this call's prompt starts with (delta "
        "tokenization extended it); None: a root (a new conversation, or a ledger break).",
    )
    branch: Branch | None = Field(
        default=None,
        description="The conversation the call belongs to, as known when it was recorded (the "
        "parent's; main for the first root with tools); None: the adapter decides.",
    )

    check_json_fields = field_validator("messages", "tools", "response_message", "sampling")(_json_field)

    @model_validator(mode="after")
    def _logprobs_match(self) -> LLMCall:
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries, "
                f"response_ids has {len(self.response_ids)}; they must match"
            )
        return self


class Reward(_Model):
    """A reward emitted by the agent (``al.emit_reward``) or the runner (the returned value)."""

    kind: Literal["reward"] = "reward"
    value: float = Field(description="The reward, finite and within +-MAX_ABS_REWARD (1e6).")
    name: str | None = None

    @field_validator("value")
    @classmethod
    def _bounded(cls, value: float) -> float:
        if not -MAX_ABS_REWARD <= value <= MAX_ABS_REWARD:
            raise ValueError(
                f"a reward must be within +-{MAX_ABS_REWARD:g} (MAX_ABS_REWARD), got {value:g}; "
                "scale the task's score down"
            )
        return value


class ToolCall(_Model):
    """A tool execution inside an agent."""

    kind: Literal["tool_call"] = "tool_call"
    name: str
    arguments: JSON = None
    result: JSON = None
    error: str | None = None
    latency_s: float | None = None

    check_json_fields = field_validator("arguments", "result")(_json_field)


class Log(_Model):
    """A free-form event."""

    kind: Literal["log"] = "log"
    message: str
    level: str = "info"
    fields: dict[str, JSON] = Field(default_factory=dict)

    check_json_fields = field_validator("fields")(_json_field)


SpanPayload = Annotated[LLMCall | Reward | ToolCall | Log, Field(discriminator="kind")]
SpanKind = Literal["llm_call", "reward", "tool_call", "log"]


class Span(_Model):
    """One recorded event of an attempt; ``sequence_id`` orders the spans of one attempt.

    Leave ``sequence_id`` as None and the store assigns the next number.
    """

    rollout_id: str
    attempt_id: str
    sequence_id: int | None = Field(default=None, ge=1)
    payload: SpanPayload
    timestamp: float = Field(default_factory=time.time)

    @property
    def kind(self) -> SpanKind:
        return self.payload.kind


# ---------------------------------------------------------------- training data


class Triplet(_Model):
    """One training sample: prompt, response and the reward it earned."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None = None
    response_mask: list[int] | None = Field(
        default=None,
        description="1 where the model produced the token (trained), 0 on tool/observation tokens.",
    )
    reward: float | None = None
    metadata: dict[str, JSON] = Field(default_factory=dict)

    check_json_fields = field_validator("metadata")(_json_field)

    @model_validator(mode="after")
    def _lengths_match(self) -> Triplet:
        n = len(self.response_ids)
        if self.response_mask is None:
            self.__dict__["response_mask"] = [1] * n
        elif len(self.response_mask) != n:
            raise ValueError(f"response_mask has {len(self.response_mask)} entries, response_ids has {n}")
        elif any(m not in (0, 1) for m in self.response_mask):
            raise ValueError("response_mask takes only 0 and 1")
        if self.response_logprobs is not None and len(self.response_logprobs) != n:
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries, response_ids has {n}"
            )
        return self
