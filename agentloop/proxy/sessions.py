"""Sessions: traffic on the plain ``/v1`` routes (apps outside training), recorded in the proxy.

An app names its session with the ``X-Session-Id`` header (the proxy makes one up when absent and
returns it in the same header). Every call is kept as an ``LLMCall`` with the exact token ids, and
the app may later ``POST /v1/sessions/{session_id}/reward``. A trainer turns a rewarded session into
training data with ``Proxy.sessions.pop(session_id)`` (or reads ``GET /v1/sessions/{session_id}``).

Why not rollouts in the store: the store's rollouts are a FIFO work queue (a rollout gets an
attempt only by being dequeued), so app traffic that never went through the queue cannot be
written there without stealing queued work. The table is bounded (least recently used sessions
are dropped first) so an app that never posts rewards cannot exhaust memory.

Durable record: with a ``SessionLog`` every call and reward is also appended, as one JSON line, to a
file (``Proxy`` puts it beside a SQLite store: ``agentloop-serve.db`` -> ``agentloop-serve.sessions.jsonl``).
Memory evictions do not touch the file; ``read_session_log`` replays it (``agentloop inspect`` does).
"""

from __future__ import annotations

import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

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

    def summary(self) -> dict[str, object]:
        """What ``GET /v1/sessions`` lists for this session."""
        return {
            "session_id": self.session_id,
            "num_calls": len(self.calls),
            "rewards": [r.model_dump(mode="json") for r in self.rewards],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "calls": [c.model_dump(mode="json") for c in self.calls],
            "rewards": [r.model_dump(mode="json") for r in self.rewards],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


SESSION_LOG_SUFFIX = ".sessions.jsonl"


def session_log_path(store_path: str | Path) -> Path:
    """Where the sessions of a proxy on the SQLite store ``store_path`` are logged (beside it)."""
    path = Path(store_path)
    return path.with_name(path.stem + SESSION_LOG_SUFFIX)


class SessionLog:
    """Append-only JSON lines: a ``server`` line (served model, tokenizer folder) when opened, then one
    ``call`` or ``reward`` line per event. The file is opened on the first event, so a proxy that
    serves no session leaves no file. Each line is flushed at once (a killed server loses nothing
    written); the writes are small appends from the event loop thread."""

    def __init__(self, path: str | Path, server: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.server = dict(server or {})
        self._file: IO[bytes] | None = None

    def _write(self, line: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
            self._file.write(orjson.dumps({"type": "server", "time": time.time(), **self.server}) + b"\n")
        self._file.write(orjson.dumps(line) + b"\n")
        self._file.flush()

    def call(self, session_id: str, call: LLMCall) -> None:
        self._write({"type": "call", "session_id": session_id, "call": call.model_dump(mode="json")})

    def reward(self, session_id: str, reward: Reward) -> None:
        self._write({"type": "reward", "session_id": session_id, "reward": reward.model_dump(mode="json")})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_session_log(path: str | Path) -> tuple[dict[str, Any], list[SessionRecord]]:
    """Replay a session log: the last ``server`` line (model, tokenizer) and the sessions in the order
    they started. A line cut short by a killed server is skipped."""
    server: dict[str, Any] = {}
    sessions: dict[str, SessionRecord] = {}
    with Path(path).open("rb") as f:
        for raw in f:
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            kind = line.get("type") if isinstance(line, dict) else None
            if kind == "server":
                server = line
                continue
            if kind not in ("call", "reward"):
                continue
            sid = str(line.get("session_id"))
            rec = sessions.get(sid)
            if rec is None:
                rec = sessions[sid] = SessionRecord(sid)
            if kind == "call":
                rec.calls.append(LLMCall.model_validate(line["call"]))
            else:
                rec.rewards.append(Reward.model_validate(line["reward"]))
    return server, list(sessions.values())


class SessionTable:
    """Bounded table of sessions (LRU eviction beyond ``max_sessions``), optionally logged to a file."""

    def __init__(
        self, max_sessions: int = 10_000, max_calls_per_session: int = 1_000, log: SessionLog | None = None
    ) -> None:
        if max_sessions < 1 or max_calls_per_session < 1:
            raise ValueError(
                f"max_sessions and max_calls_per_session must be >= 1, got {max_sessions}, {max_calls_per_session}"
            )
        self.max_sessions, self.max_calls = max_sessions, max_calls_per_session
        self.log = log
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
        if self.log is not None:
            self.log.call(session_id, call)

    def add_reward(self, session_id: str, reward: Reward) -> SessionRecord:
        """Record a reward; raises KeyError for a session the proxy has not seen (or has dropped)."""
        if session_id not in self._sessions:
            raise KeyError(session_id)
        rec = self._touch(session_id)
        rec.rewards.append(reward)
        if self.log is not None:
            self.log.reward(session_id, reward)
        return rec

    def records(self) -> list[SessionRecord]:
        """The sessions held in memory, least recently used first."""
        return list(self._sessions.values())

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> SessionRecord | None:
        """Remove and return a session (for example once a trainer has taken it)."""
        return self._sessions.pop(session_id, None)
