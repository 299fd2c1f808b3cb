"""Sessions: traffic on the plain ``/v1`` routes (apps outside training), recorded in the proxy.

An app names its session with the ``X-Session-Id`` header (the proxy makes one up when absent and
returns it in the same header). Every call is kept as an ``LLMCall`` with the exact token ids, and
the app may later ``POST /v1/sessions/{session_id}/reward``. A trainer turns a rewarded session into
training data with ``Proxy.sessions.pop(session_id)`` (or reads ``GET /v1/sessions/{session_id}``).

Why not rollouts in the store: the store's rollouts are a FIFO work queue (a rollout gets an
attempt only by being dequeued), so app traffic that never went through the queue cannot be
written there without stealing queued work.

Durable record: with a ``SessionLog`` (``Proxy`` puts it beside a SQLite store:
``agentloop-serve.db`` -> ``agentloop-serve.sessions.jsonl``) the log is the authority. Every call,
reward and removal is appended as one JSON line and flushed before the call is answered (a killed
server loses nothing it answered; as the store's span writes, an OS crash may lose the last lines),
and a table opened on an existing log replays it, so the sessions survive a restart of
``agentloop serve`` and ``agentloop inspect`` reads them from the same file.

Bounds (``SessionTable``'s arguments; the defaults need no tuning):

- a session unused for ``ttl_s`` is dropped, with its token ledger (``on_drop``);
- ``max_calls_per_session`` calls and ``max_session_bytes`` of call JSON per session (the oldest
  calls go first), ``max_rewards_per_session`` rewards (more is a 409);
- ``max_sessions`` sessions and ``max_total_bytes`` of call JSON over all of them (the least
  recently used sessions go first); the memory held follows: calls are kept as their JSON bytes;
- the log is rewritten with only the live sessions (to a temporary file, fsynced, renamed) when
  dropped lines make up more than half of it and it is over ``COMPACT_MIN_BYTES``, so the file stays
  under about twice ``max_total_bytes``.

Calls answered with an error (``context_length_exceeded``) are not kept (the service does not record
them for sessions). One server writes a log at a time (two ``agentloop serve`` on one store would
each rewrite it without the other's lines).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, overload

import orjson

from agentloop.proxy.schemas import ProxyError
from agentloop.types import LLMCall, Reward

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MiB = 1024 * 1024


def new_session_id() -> str:
    return "se-" + secrets.token_hex(16)


def valid_session_id(value: str) -> bool:
    return bool(_SESSION_ID.match(value))


class CallsView(Sequence[LLMCall]):
    """A read-only sequence of LLMCalls over their JSON: an item is parsed when read."""

    def __init__(self, raw: list[bytes]) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, index: int) -> LLMCall: ...
    @overload
    def __getitem__(self, index: slice) -> list[LLMCall]: ...
    def __getitem__(self, index: int | slice) -> LLMCall | list[LLMCall]:
        if isinstance(index, slice):
            return [LLMCall.model_validate_json(raw) for raw in self._raw[index]]
        return LLMCall.model_validate_json(self._raw[index])

    def __repr__(self) -> str:
        return f"CallsView({len(self._raw)} calls)"


@dataclass
class SessionRecord:
    """The calls and rewards of one app session. Calls are held as their JSON (``LLMCall`` dumps), so
    the bytes counted against the caps are the memory held; ``calls`` parses them."""

    session_id: str
    call_json: list[bytes] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    nbytes: int = 0  # bytes of call_json

    @property
    def calls(self) -> CallsView:
        """The calls as LLMCalls, each parsed when read (``len`` parses nothing)."""
        return CallsView(self.call_json)

    def summary(self) -> dict[str, object]:
        """What ``GET /v1/sessions`` lists for this session."""
        return {
            "session_id": self.session_id,
            "num_calls": len(self.call_json),
            "rewards": [r.model_dump(mode="json") for r in self.rewards],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "calls": [orjson.loads(raw) for raw in self.call_json],
            "rewards": [r.model_dump(mode="json") for r in self.rewards],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


SESSION_LOG_SUFFIX = ".sessions.jsonl"


def session_log_path(store_path: str | Path) -> Path:
    """Where the sessions of a proxy on the SQLite store ``store_path`` are logged (beside it)."""
    path = Path(store_path)
    return path.with_name(path.stem + SESSION_LOG_SUFFIX)


def _line(kind: str, session_id: str, **fields: Any) -> bytes:
    return orjson.dumps({"type": kind, "session_id": session_id, **fields}) + b"\n"


def _call_line(session_id: str, call_json: bytes, at: float | None) -> bytes:
    head = orjson.dumps({"type": "call", "session_id": session_id, "time": at})
    return head[:-1] + b',"call":' + call_json + b"}\n"


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SessionLog:
    """Append-only JSON lines: a ``server`` line (served model, tokenizer folder) when opened, then one
    line per event: ``call``, ``reward``, ``drop`` (a session removed), and ``session`` (its times,
    written by a rewrite). The file is opened on the first event, so a proxy that serves no session
    leaves no file. Each line is flushed at once; the writes are small appends from the event loop
    thread."""

    def __init__(self, path: str | Path, server: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.server = dict(server or {})
        self._file: IO[bytes] | None = None
        self.size = self.path.stat().st_size if self.path.exists() else 0  # bytes in the file

    def _server_line(self) -> bytes:
        return orjson.dumps({"type": "server", "time": time.time(), **self.server}) + b"\n"

    def append(self, line: bytes) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
            if self._file.tell() and not _ends_with_newline(self.path):  # a line torn by a kill
                self._file.write(b"\n")  # ends it, so the next line is whole
                self.size += 1
            head = self._server_line()
            self._file.write(head)
            self.size += len(head)
        self._file.write(line)
        self._file.flush()
        self.size += len(line)

    def call(self, session_id: str, call: LLMCall) -> None:
        self.append(_call_line(session_id, orjson.dumps(call.model_dump(mode="json")), time.time()))

    def reward(self, session_id: str, reward: Reward) -> None:
        self.append(_line("reward", session_id, time=time.time(), reward=reward.model_dump(mode="json")))

    def rewrite(self, lines: Iterable[bytes]) -> None:
        """Replace the file with a server line and ``lines``: written to a temporary file, fsynced,
        renamed over the log (a crash leaves the old file or the new one), the folder fsynced."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        size = 0
        with tmp.open("wb") as f:
            for line in [self._server_line(), *lines]:
                f.write(line)
                size += len(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._file, self.size = self.path.open("ab"), size

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The log's lines as dicts; a line cut short by a killed server (or not JSON) is skipped."""
    with path.open("rb") as f:
        for raw in f:
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(line, dict) and isinstance(line.get("type"), str):
                yield line


def read_session_log(path: str | Path) -> tuple[dict[str, Any], list[SessionRecord]]:
    """Replay a session log as it stands (no caps applied): the last ``server`` line (model,
    tokenizer) and the sessions still in it (dropped ones left out), least recently used first."""
    table = SessionTable(
        max_sessions=1 << 62, max_calls_per_session=1 << 62, ttl_s=float("inf"),
        max_session_bytes=1 << 62, max_total_bytes=1 << 62, max_rewards_per_session=1 << 62,
    )  # fmt: skip
    server = table.replay(Path(path))
    return server, table.records()


class SessionTable:
    """Bounded table of sessions (module docstring), optionally backed by a log that it replays."""

    COMPACT_MIN_BYTES = 32 * MiB  # a smaller log is never rewritten

    def __init__(
        self,
        max_sessions: int = 10_000,
        max_calls_per_session: int = 1_000,
        log: SessionLog | None = None,
        *,
        ttl_s: float = 24 * 3600.0,  # a day: long enough for an app's delayed feedback
        max_session_bytes: int = 16 * MiB,  # a long agent conversation's calls, with token ids
        max_total_bytes: int = 256 * MiB,  # the memory (and about half the log) sessions may hold
        max_rewards_per_session: int = 100,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if min(max_sessions, max_calls_per_session, max_session_bytes, max_rewards_per_session) < 1:
            raise ValueError(
                "max_sessions, max_calls_per_session, max_session_bytes and max_rewards_per_session must "
                f"be >= 1, got {max_sessions}, {max_calls_per_session}, {max_session_bytes}, "
                f"{max_rewards_per_session}"
            )
        if max_total_bytes < max_session_bytes:
            raise ValueError(
                f"max_total_bytes ({max_total_bytes}) must be >= max_session_bytes ({max_session_bytes})"
            )
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_sessions, self.max_calls = max_sessions, max_calls_per_session
        self.ttl_s, self.max_session_bytes, self.max_total_bytes = ttl_s, max_session_bytes, max_total_bytes
        self.max_rewards = max_rewards_per_session
        self.clock = clock
        self.log = log
        self.on_drop: Callable[[str], None] | None = None  # called with each removed session's id
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()  # least recently used first
        self._bytes = 0  # call JSON held over all sessions
        if log is not None and log.path.exists():
            self.replay(log.path)
            if log.size > 2 * self._bytes + MiB:  # dropped or expired sessions linger in it: rewrite
                self.compact()

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        self._expire()
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        """Bytes of call JSON held over all sessions (what ``max_total_bytes`` bounds)."""
        return self._bytes

    def ids(self) -> list[str]:
        self._expire()
        return list(self._sessions)

    # ------------------------------------------------------------ bounds

    def _remove(self, session_id: str, logged: bool = True) -> SessionRecord | None:
        rec = self._sessions.pop(session_id, None)
        if rec is None:
            return None
        self._bytes -= rec.nbytes
        if logged and self.log is not None:
            self.log.append(_line("drop", session_id, time=self.clock()))
        if self.on_drop is not None:
            self.on_drop(session_id)
        return rec

    def _expire(self, logged: bool = True) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._sessions:
            sid, rec = next(iter(self._sessions.items()))
            if rec.updated_at >= cutoff:
                break
            self._remove(sid, logged)

    def _trim(self, rec: SessionRecord) -> None:
        while rec.call_json and (len(rec.call_json) > self.max_calls or rec.nbytes > self.max_session_bytes):
            size = len(rec.call_json.pop(0))
            rec.nbytes -= size
            self._bytes -= size

    def _evict(self, keep: str, logged: bool = True) -> None:
        while len(self._sessions) > self.max_sessions or self._bytes > self.max_total_bytes:
            sid = next(iter(self._sessions))
            if sid == keep:  # pragma: no cover - max_session_bytes <= max_total_bytes keeps it in bounds
                break
            self._remove(sid, logged)

    def _touch(self, session_id: str, at: float | None) -> SessionRecord:
        now = self.clock() if at is None else at
        rec = self._sessions.get(session_id)
        if rec is None:
            rec = self._sessions[session_id] = SessionRecord(session_id, created_at=now, updated_at=now)
        else:
            self._sessions.move_to_end(session_id)
            rec.updated_at = max(rec.updated_at, now)
        return rec

    def _add_call_json(self, session_id: str, raw: bytes, at: float | None, logged: bool) -> SessionRecord:
        rec = self._touch(session_id, at)
        rec.call_json.append(raw)
        rec.nbytes += len(raw)
        self._bytes += len(raw)
        self._trim(rec)
        self._evict(session_id, logged)
        return rec

    # ------------------------------------------------------------ events

    def add_call(self, session_id: str, call: LLMCall) -> bool:
        """Record a call; False (nothing kept) when the call alone is over ``max_session_bytes``."""
        raw = orjson.dumps(call.model_dump(mode="json"))
        if len(raw) > self.max_session_bytes:
            return False
        self._expire()
        now = self.clock()
        self._add_call_json(session_id, raw, now, logged=True)
        if self.log is not None:
            self.log.append(_call_line(session_id, raw, now))
            self._maybe_compact()
        return True

    def add_reward(self, session_id: str, reward: Reward) -> SessionRecord:
        """Record a reward; KeyError for a session the proxy has not seen (or has dropped); a 409
        ProxyError when the session already has ``max_rewards_per_session``."""
        self._expire()
        rec = self._sessions.get(session_id)
        if rec is None:
            raise KeyError(session_id)
        if len(rec.rewards) >= self.max_rewards:
            raise ProxyError(
                409,
                f"session {session_id!r} already has {len(rec.rewards)} rewards, the limit; "
                "post one reward per outcome (or sum them in the app)",
                "conflict_error",
                code="too_many_rewards",
            )
        rec = self._touch(session_id, None)
        rec.rewards.append(reward)
        if self.log is not None:
            self.log.append(
                _line("reward", session_id, time=self.clock(), reward=reward.model_dump(mode="json"))
            )
        return rec

    def records(self) -> list[SessionRecord]:
        """The sessions held, least recently used first."""
        self._expire()
        return list(self._sessions.values())

    def get(self, session_id: str) -> SessionRecord | None:
        self._expire()
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> SessionRecord | None:
        """Remove and return a session (for example once a trainer has taken it); the log says so."""
        self._expire()
        return self._remove(session_id)

    # ------------------------------------------------------------ the log

    def replay(self, path: Path) -> dict[str, Any]:
        """Apply a log's lines to this table (the caps and the TTL hold as they would have when the
        events came); returns the last ``server`` line."""
        server: dict[str, Any] = {}
        for line in _read_lines(path):
            kind, sid = line["type"], str(line.get("session_id"))
            at = line.get("time")
            if not isinstance(at, int | float):  # a rewritten log's lines: its session line has the times
                at = server.get("time") if isinstance(server.get("time"), int | float) else None
            if kind == "server":
                server = line
            elif kind == "call" and isinstance(line.get("call"), dict):
                self._add_call_json(sid, orjson.dumps(line["call"]), at, logged=False)
            elif kind == "reward" and isinstance(line.get("reward"), dict):
                try:
                    reward = Reward.model_validate(line["reward"])
                except ValueError:  # not a reward this version reads: the line is skipped, not the log
                    continue
                rec = self._touch(sid, at)
                if len(rec.rewards) < self.max_rewards:
                    rec.rewards.append(reward)
            elif kind == "session":
                rec = self._touch(sid, at)
                created, updated = line.get("created_at"), line.get("updated_at")
                rec.created_at = float(created) if isinstance(created, int | float) else rec.created_at
                rec.updated_at = float(updated) if isinstance(updated, int | float) else rec.updated_at
            elif kind == "drop":
                self._remove(sid, logged=False)
        self._expire(logged=False)
        return server

    def _maybe_compact(self) -> None:
        if self.log is not None and self.log.size > max(2 * self._bytes, self.COMPACT_MIN_BYTES):
            self.compact()

    def compact(self) -> None:
        """Rewrite the log with the live sessions only (see ``SessionLog.rewrite``)."""
        if self.log is None:
            return
        self._expire(logged=False)

        def lines() -> Iterator[bytes]:
            for rec in self._sessions.values():
                for raw in rec.call_json:
                    yield _call_line(rec.session_id, raw, None)
                for reward in rec.rewards:
                    yield _line("reward", rec.session_id, reward=reward.model_dump(mode="json"))
                yield _line("session", rec.session_id, created_at=rec.created_at, updated_at=rec.updated_at)

        self.log.rewrite(lines())
