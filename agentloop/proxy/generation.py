"""One call's records: where it is recorded (``Target``) and what it answered (``Generation``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentloop.proxy.schemas import JSONDict


@dataclass(frozen=True)
class Target:
    """Where a call is recorded: one rollout attempt, or one app session."""

    rollout_id: str | None = None
    attempt_id: str | None = None
    session_id: str | None = None
    owner: str = ""  # a session's: the caller's owner id (agentloop/proxy/access.py)
    admin: bool = False  # a session's: the caller holds the admin key (may use any session)

    @property
    def key(self) -> str:
        return f"session/{self.session_id}" if self.session_id else f"{self.rollout_id}/{self.attempt_id}"


@dataclass
class Generation:
    """A finished generation, ready to be written as JSON or as SSE chunks."""

    id: str
    created: int
    model: str
    prompt_ids: list[int]
    token_ids: list[int]  # exactly what the engine produced (end-of-turn id included)
    logprobs: list[float] | None
    text_ids: list[int]  # token_ids without a final end-of-turn id: the ids that make the text
    content: str | None
    tool_calls: list[JSONDict] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def usage(self) -> JSONDict:
        n, m = len(self.prompt_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
