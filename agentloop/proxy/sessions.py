"""Sessions: traffic on the plain ``/v1`` routes (apps outside training), recorded in the proxy.

An app names its session with the ``X-Session-Id`` header (the proxy makes one up when absent and
returns it in the same header). Every call is kept as an ``LLMCall`` with the exact token ids, and
the app may later ``POST /v1/sessions/{session_id}/reward``. A trainer turns a rewarded session into
training data with ``Proxy.sessions.pop(session_id)`` (or reads ``GET /v1/sessions/{session_id}``).

Why not rollouts in the store: the store's rollouts are a FIFO work queue (a rollout gets an
attempt only by being dequeued), so app traffic that never went through the queue cannot be
written there without stealing queued work.

Durable record: given a ``SessionJournal`` (``Proxy`` makes one on a ``SQLiteStore``, which is what
``agentloop serve --store X.db`` opens), every call, reward and removal is written into the store's
session tables (``agentloop/store/sessions.py``) and committed before the app is answered (a killed
server loses nothing it answered), and a table opened on a store starts with the sessions it holds,
so they survive a restart of ``agentloop serve`` and ``agentloop inspect X.db`` shows them.

Owners: a session belongs to the key that created it (``SessionRecord.owner``, a fingerprint of the
key, saved with the session); another app key is answered 404 on it, as for an unknown session, and
only the admin key sees every session (agentloop/proxy/access.py).

Bounds (``SessionTable``'s arguments; the defaults need no tuning):

- a session unused for ``ttl_s`` is dropped, with its token ledger (``on_drop``);
- ``max_calls_per_session`` calls and ``max_session_bytes`` of call JSON per session (the oldest
  calls go first), ``max_rewards_per_session`` rewards (more is a 409);
- ``max_sessions`` sessions and ``max_total_bytes`` of call JSON over all of them (the least
  recently used sessions go first); the memory held follows: calls are kept as their JSON bytes;
- the store holds what the table holds: each cap or TTL removal deletes the rows too.

Calls answered with an error (``context_length_exceeded``) are not kept (the service does not record
them for sessions). One server serves a store's sessions at a time (a second ``agentloop serve`` on
the same store would not see the first one's new sessions until it restarts).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import orjson

from agentloop.proxy.schemas import ProxyError
from agentloop.store.sessions import SavedSession, SessionJournal, Trained, read_sessions
from agentloop.types import LLMCall, Reward, Span

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MiB = 1024 * 1024


def session_not_found(session_id: str) -> ProxyError:
    """The 404 for an unknown session, and for another key's (the same answer: nothing is revealed)."""
    return ProxyError(404, f"session {session_id!r} not found", "not_found_error", code="not_found")


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
    owner: str = ""  # who may use it: the fingerprint of the key that created it (agentloop/proxy/access.py)
    call_json: list[bytes] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    reward_after: list[int] = field(default_factory=list)  # calls the session had when each reward came
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    nbytes: int = 0  # bytes of call_json
    trained: Trained | None = None  # read from a store: the online update that took it (None: not trained)

    @property
    def calls(self) -> CallsView:
        """The calls as LLMCalls, each parsed when read (``len`` parses nothing)."""
        return CallsView(self.call_json)

    @property
    def total_reward(self) -> float | None:
        """The sum of the session's rewards; None when it has none."""
        return sum(r.value for r in self.rewards) if self.rewards else None

    def spans(self) -> list[Span]:
        """The calls and rewards as the spans of one attempt (id: the session's), each reward after the
        calls the session had when it was posted (so ``per_call`` credit gives it to the call before it):
        what ``agentloop.adapter.spans_to_triplets`` turns into training samples."""
        calls = self.calls[:]
        after = (
            self.reward_after
            if len(self.reward_after) == len(self.rewards)
            else [len(calls)] * len(self.rewards)
        )
        payloads: list[LLMCall | Reward] = []
        for i, call in enumerate([None, *calls]):
            if call is not None:
                payloads.append(call)
            payloads += [
                r for r, n in zip(self.rewards, after, strict=True) if min(max(n, 0), len(calls)) == i
            ]
        return [
            Span(rollout_id=self.session_id, attempt_id=self.session_id, sequence_id=i, payload=payload)
            for i, payload in enumerate(payloads, start=1)
        ]

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


def record_from_saved(saved: SavedSession) -> SessionRecord:
    """A session read from the store as a SessionRecord (a reward this version cannot read is skipped)."""
    rec = SessionRecord(
        saved.session_id, owner=saved.owner, created_at=saved.created_at, updated_at=saved.updated_at,
        trained=saved.trained,
    )  # fmt: skip
    rec.call_json = list(saved.calls)
    rec.nbytes = sum(len(raw) for raw in rec.call_json)
    for reward in saved.rewards:
        fields = dict(reward)
        after = fields.pop("after_calls", len(rec.call_json))
        with contextlib.suppress(ValueError, TypeError):
            n, value = int(after), Reward.model_validate(fields)
            rec.rewards.append(value)
            rec.reward_after.append(n)
    return rec


def read_saved_sessions(store_path: str | Path) -> tuple[dict[str, Any], list[SessionRecord]]:
    """The sessions in a SQLite store as they stand (read-only, no caps applied): the ``serve`` meta
    (model, tokenizer) and the sessions, least recently used first."""
    meta, saved = read_sessions(store_path)
    return meta, [record_from_saved(s) for s in saved]


class SessionTable:
    """Bounded table of sessions (module docstring), optionally saved in a SQLite store through a
    ``SessionJournal``; a table given a journal starts with the sessions the store holds."""

    def __init__(
        self,
        max_sessions: int = 10_000,
        max_calls_per_session: int = 1_000,
        journal: SessionJournal | None = None,
        *,
        ttl_s: float = 24 * 3600.0,  # a day: long enough for an app's delayed feedback
        max_session_bytes: int = 16 * MiB,  # a long agent conversation's calls, with token ids
        max_total_bytes: int = 256 * MiB,  # the memory (and the store's rows) sessions may hold
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
        self.journal = journal
        self.on_drop: Callable[[str], None] | None = None  # called with each removed session's id
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()  # least recently used first
        self._bytes = 0  # call JSON held over all sessions
        if journal is not None:
            _, saved = read_sessions(journal.path, read_only=False)
            self._load([record_from_saved(s) for s in saved if s.trained is None])  # trained: audit only
            journal.flush_sync()  # the trims and drops the caps made on load

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

    def _detach(self, session_id: str) -> SessionRecord | None:
        """Take a session out of memory (the store is told by the caller)."""
        rec = self._sessions.pop(session_id, None)
        if rec is not None:
            self._bytes -= rec.nbytes
        return rec

    def _remove(self, session_id: str) -> SessionRecord | None:
        rec = self._detach(session_id)
        if rec is None:
            return None
        if self.journal is not None:
            self.journal.drop(session_id)
        if self.on_drop is not None:
            self.on_drop(session_id)
        return rec

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._sessions:
            sid, rec = next(iter(self._sessions.items()))
            if rec.updated_at >= cutoff:
                break
            self._remove(sid)

    def _trim(self, rec: SessionRecord) -> None:
        before = len(rec.call_json)
        while rec.call_json and (len(rec.call_json) > self.max_calls or rec.nbytes > self.max_session_bytes):
            size = len(rec.call_json.pop(0))
            rec.nbytes -= size
            self._bytes -= size
        if len(rec.call_json) < before and self.journal is not None:
            self.journal.trim(rec.session_id, len(rec.call_json))

    def _evict(self, keep: str) -> None:
        while len(self._sessions) > self.max_sessions or self._bytes > self.max_total_bytes:
            sid = next(iter(self._sessions))
            if sid == keep:  # pragma: no cover - max_session_bytes <= max_total_bytes keeps it in bounds
                break
            self._remove(sid)

    def _touch(self, session_id: str, now: float, owner: str = "") -> SessionRecord:
        rec = self._sessions.get(session_id)
        if rec is None:
            rec = self._sessions[session_id] = SessionRecord(
                session_id, owner=owner, created_at=now, updated_at=now
            )
        else:
            self._sessions.move_to_end(session_id)
            rec.updated_at = max(rec.updated_at, now)
        return rec

    def _load(self, records: list[SessionRecord]) -> None:
        """Start from the sessions a store held (least recently used first), the caps and TTL applied
        now (the store is told what they removed)."""
        for rec in records:
            self._sessions[rec.session_id] = rec
            self._bytes += rec.nbytes
            self._trim(rec)
        if records:
            self._evict(keep=records[-1].session_id)
        self._expire()

    # ------------------------------------------------------------ events

    def add_call(self, session_id: str, call: LLMCall, owner: str = "", *, any_owner: bool = False) -> bool:
        """Record a call; a new session is ``owner``'s. False (nothing kept) when the call alone is over
        ``max_session_bytes``; a 404 ProxyError when the session is another owner's (``any_owner``:
        the admin, who may write into any)."""
        raw = orjson.dumps(call.model_dump(mode="json"))
        if len(raw) > self.max_session_bytes:
            return False
        self._expire()
        held = self._sessions.get(session_id)
        if held is not None and not any_owner and held.owner != owner:
            raise session_not_found(session_id)
        now = self.clock()
        rec = self._touch(session_id, now, owner)
        rec.call_json.append(raw)
        rec.nbytes += len(raw)
        self._bytes += len(raw)
        if self.journal is not None:
            self.journal.call(session_id, raw, at=now, created_at=rec.created_at, owner=rec.owner)
        self._trim(rec)
        self._evict(session_id)
        return True

    def add_reward(
        self, session_id: str, reward: Reward, owner: str = "", *, any_owner: bool = False
    ) -> SessionRecord:
        """Record a reward; KeyError for a session the proxy has not seen (or has dropped) and for
        another owner's (unless ``any_owner``); a 409 ProxyError when the session already has
        ``max_rewards_per_session``."""
        self._expire()
        rec = self._sessions.get(session_id)
        if rec is None or (not any_owner and rec.owner != owner):
            raise KeyError(session_id)
        if len(rec.rewards) >= self.max_rewards:
            raise ProxyError(
                409,
                f"session {session_id!r} already has {len(rec.rewards)} rewards, the limit; "
                "post one reward per outcome (or sum them in the app)",
                "conflict_error",
                code="too_many_rewards",
            )
        now = self.clock()
        rec = self._touch(session_id, now)
        rec.rewards.append(reward)
        rec.reward_after.append(len(rec.call_json))
        if self.journal is not None:
            saved = [
                {**r.model_dump(mode="json"), "after_calls": n}
                for r, n in zip(rec.rewards, rec.reward_after, strict=True)
            ]
            self.journal.rewards(session_id, saved, at=now)
        return rec

    async def flush(self) -> None:
        """Wait until the store has saved every change so far (no-op without a journal); raises what
        the store raised."""
        if self.journal is not None:
            await self.journal.flush()

    def records(self) -> list[SessionRecord]:
        """The sessions held, least recently used first."""
        self._expire()
        return list(self._sessions.values())

    def get(self, session_id: str) -> SessionRecord | None:
        self._expire()
        return self._sessions.get(session_id)

    def adopt_unowned(self, owner: str) -> int:
        """Give ``owner`` the sessions that have none (made without a key, or saved before sessions had
        owners), in memory and in the store; how many. ``Proxy`` does this when it has exactly one app
        key: a server that used to run with one key, or none, keeps serving its sessions to that key."""
        self._expire()
        adopted = [rec for rec in self._sessions.values() if not rec.owner]
        for rec in adopted:
            rec.owner = owner
            if self.journal is not None:
                self.journal.owner(rec.session_id, owner)
        return len(adopted)

    def pop(self, session_id: str) -> SessionRecord | None:
        """Remove and return a session; the store drops it."""
        self._expire()
        return self._remove(session_id)

    def take_for_training(self, session_id: str, update: int, run: str) -> SessionRecord | None:
        """Remove and return a session an online update trains on; the store keeps it, marked with the
        update and ``run`` folder, under an archive id (``SessionJournal.trained``). ``on_drop`` is not
        called: the session was used, not lost."""
        self._expire()
        rec = self._detach(session_id)
        if rec is not None and self.journal is not None:
            self.journal.trained(session_id, update, run, self.clock())
        return rec
