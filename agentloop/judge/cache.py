"""Verdicts and their cache: the same group is never sent to the judge twice.

A verdict is kept by a digest of (rubric, task, trajectories, judge model, served weights version,
max_chars), in memory (least recently used dropped past ``CACHE_LIMIT``) and, with a file, on disk as
one JSON line per verdict, raw answer included (the trainer uses ``judge.jsonl`` in the run folder).
The file is read on first use; a line cut by a crash is skipped (that group is judged again if needed).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CACHE_LIMIT", "Verdict", "VerdictCache", "verdict_key"]

CACHE_LIMIT = 100_000  # verdicts kept in memory; ~1 KB each


@dataclass
class Verdict:
    """One group's judgment: a score per trajectory, in the order they were given."""

    scores: list[float]
    explanations: list[str]
    model: str  # the judge model that answered
    key: str  # the cache key: digest of rubric, task, trajectories, model (and weights version)
    raw: str = ""  # the judge's answer text
    tries: int = 1  # requests it took (1 + retries); 0 when it came from the cache
    cached: bool = False
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # what the caller adds (rollout ids, step)


def verdict_key(rubric: str, task: str, trajectories: Any, model: str, version: Any, max_chars: int) -> str:
    """The digest a verdict is cached under (``task`` as the judge is shown it)."""
    text = json.dumps([rubric, task, trajectories, model, version, max_chars], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class VerdictCache:
    """Verdicts by key, in memory and (with ``path``) appended to a JSON-lines file."""

    def __init__(self, path: str | Path | None = None, limit: int = CACHE_LIMIT) -> None:
        self.path = Path(path) if path is not None else None
        self.limit = limit
        self._entries: OrderedDict[str, Verdict] = OrderedDict()
        self._loaded = False

    def __len__(self) -> int:
        return len(self._entries)

    def copy(self, path: str | Path | None) -> VerdictCache:
        """The same verdicts in memory, kept from now on in ``path`` (read on first use)."""
        other = VerdictCache(path, self.limit)
        other._entries = OrderedDict(self._entries)
        return other

    def get(self, key: str) -> Verdict | None:
        """The verdict under ``key`` as a cache hit (``tries`` 0, ``cached``), or None."""
        self._load()
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return Verdict(hit.scores, hit.explanations, hit.model, key, hit.raw, 0, True)

    def put(self, verdict: Verdict) -> None:
        """Keep ``verdict`` under its key (and append it to the file)."""
        self._load()
        self._entries[verdict.key] = verdict
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(verdict), ensure_ascii=False) + "\n")

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if self.path is None or not self.path.is_file():
            return
        for line in self.path.read_text().splitlines():
            try:
                data = json.loads(line)
                self._entries[data["key"]] = Verdict(**data)
            except (ValueError, KeyError, TypeError):  # a line cut by a crash: judged again if needed
                continue
