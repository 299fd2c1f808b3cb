"""Sessions: traffic on the plain ``/v1`` routes (apps outside training), recorded in the proxy.

An app names its session with the ``X-Session-Id`` header (the proxy makes one up when absent and
returns it in the same header). Every call is kept as an ``LLMCall`` with the exact token ids, and
the app may later ``POST /v1/sessions/{session_id}/reward``. A trainer turns a rewarded session into
training data with ``Proxy.sessions.pop(session_id)`` (or reads ``GET /v1/sessions/{session_id}``).

Why not rollouts in the store: the store's rollouts are a FIFO work queue (a rollout gets an
attempt only by being dequeued), so app traffic that never went through the queue cannot be
written there without stealing queued work. The table is bounded (least recently used sessions
are dropped first) so an app that never posts rewards cannot exhaust memory.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from agentloop.types import LLMCall, Reward

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def new_session_id() -> str:
    return "se-" + secrets.token_hex(16)


def valid_session_id(value: str) -> bool:
    return bool(_SESSION_ID.match(value))


@dataclass
class SessionRecord:
    """The calls and rewards of one app session."""

    session_id: str
    calls: list[LLMCall] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "calls": [c.model_dump(mode="json") for c in self.calls],
            "rewards": [r.model_dump(mode="json") for r in self.rewards],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


class SessionTable:
    """Bounded table of sessions (LRU eviction beyond ``max_sessions``)."""

    def __init__(self, max_sessions: int = 10_000, max_calls_per_session: int = 1_000) -> None:
        if max_sessions < 1 or max_calls_per_session < 1:
            raise ValueError(
                f"max_sessions and max_calls_per_session must be >= 1, got {max_sessions}, {max_calls_per_session}"
            )
        self.max_sessions, self.max_calls = max_sessions, max_calls_per_session
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def ids(self) -> list[str]:
        return list(self._sessions)

    def _touch(self, session_id: str) -> SessionRecord:
        rec = self._sessions.get(session_id)
        if rec is None:
            rec = self._sessions[session_id] = SessionRecord(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
            rec.updated_at = time.time()
        return rec

    def add_call(self, session_id: str, call: LLMCall) -> None:
        rec = self._touch(session_id)
        rec.calls.append(call)
        if len(rec.calls) > self.max_calls:
            del rec.calls[0]

    def add_reward(self, session_id: str, reward: Reward) -> SessionRecord:
        """Record a reward; raises KeyError for a session the proxy has not seen (or has dropped)."""
        if session_id not in self._sessions:
            raise KeyError(session_id)
        rec = self._touch(session_id)
        rec.rewards.append(reward)
        return rec

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> SessionRecord | None:
        """Remove and return a session (for example once a trainer has taken it)."""
        return self._sessions.pop(session_id, None)
