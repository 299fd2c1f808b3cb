"""SFT's data: the recorded attempts that pass the ``sft`` filters (as merged samples), the held-out
split by whole tasks, and the padded Batch the loss reads."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentloop.adapter import spans_to_triplets
from agentloop.errors import EmptyBatchError
from agentloop.store.base import Store
from agentloop.types import Attempt, AttemptStatus, Rollout, RolloutStatus, Triplet
from trainer.batch import Batch, build_batch
from trainer.config import TrainerConfig
from trainer.sft.config import SFTConfig


@dataclass
class Selection:
    """The chosen attempts (each a list of merged samples) and what the store held."""

    attempts: list[list[Triplet]]
    tasks: list[str]  # the task key of each attempt (its rollout input as JSON)
    seen: Counter[str] = field(default_factory=Counter)  # "mode/status" -> rollouts
    rewards: Counter[str] = field(default_factory=Counter)  # reward of the attempts of the right mode


def open_store(path: str | Path) -> Store:
    """A SQLiteStore on an existing agentloop store: the file, or a run folder's ``store.db``.

    Checked read-only first: a missing path or a file that is not an agentloop store is an error,
    never a new store (SQLiteStore creates what it does not find)."""
    from agentloop.store.sqlite import SQLiteStore

    p = Path(path)
    if p.is_dir():
        p = p / "store.db"
    if not p.is_file():
        where = "has no store.db" if p.name == "store.db" and p.parent.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"store {str(path)!r} {where}; give a run folder written by training or a store file"
        )
    try:
        conn = sqlite3.connect("file:" + urllib.parse.quote(str(p.resolve())) + "?mode=ro", uri=True)
        try:
            conn.execute("SELECT 1 FROM rollouts LIMIT 1")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise ValueError(f"{p} is not an agentloop store ({exc})") from None
    return SQLiteStore(p)


async def select_attempts(store: Store, sft: SFTConfig, strategy: Any = "identical") -> Selection:
    """The attempts of ``store`` that pass ``sft``'s filters, as merged samples (adapter.merge_turns).

    Raises EmptyBatchError when none does, naming what the store holds (modes, statuses, rewards)."""
    from agentloop.adapter import merge_turns

    chosen = Selection(attempts=[], tasks=[])
    for rollout in await store.list_rollouts():
        chosen.seen[f"{rollout.mode}/{rollout.status.value}"] += 1
        if rollout.mode not in sft.modes or not rollout.num_attempts:
            continue
        for attempt_id in await _attempt_ids(store, rollout, sft.include_failed):
            spans = await store.query_spans(rollout.rollout_id, attempt_id)
            triplets = spans_to_triplets(spans, strategy, rollout=rollout).triplets
            reward = _attempt_reward(triplets)
            chosen.rewards["none" if reward is None else f"{reward:g}"] += 1
            if not triplets or (sft.min_reward is not None and (reward is None or reward < sft.min_reward)):
                continue
            chosen.attempts.append(
                merge_turns([t.model_copy(update={"reward": reward or 0.0}) for t in triplets])
            )
            chosen.tasks.append(json.dumps(rollout.input, sort_keys=True, default=str))
    if not chosen.attempts:
        raise EmptyBatchError(_nothing_matches(chosen, sft))
    return chosen


async def _attempt_ids(store: Store, rollout: Rollout, include_failed: bool) -> list[str]:
    if not include_failed:
        if rollout.status is not RolloutStatus.SUCCEEDED:
            return []
        return ["latest"]  # a rollout ends at its first succeeded attempt: the latest one
    attempts: list[Attempt] = await store.list_attempts(rollout.rollout_id)
    active = (AttemptStatus.PREPARING, AttemptStatus.RUNNING)
    return [a.attempt_id for a in attempts if a.status not in active]


def _attempt_reward(triplets: list[Triplet]) -> float | None:
    """The attempt's total reward (the sum of its Reward spans), None without one."""
    for t in triplets:
        total = t.metadata.get("attempt_reward")
        if isinstance(total, int | float):
            return float(total)
    return None


def _nothing_matches(chosen: Selection, sft: SFTConfig) -> str:
    total = sum(chosen.seen.values())
    if not total:
        return "the store holds no rollouts; record some first (agentloop train, a Runner, agentloop serve --train)"
    held = ", ".join(f"{n} {k}" for k, n in sorted(chosen.seen.items()))
    rewards = ", ".join(f"{k} x {n}" for k, n in sorted(chosen.rewards.items(), key=lambda kv: kv[0]))
    which = "attempts" if sft.include_failed else "succeeded attempts"
    got = f"their {which} scored: {rewards}" if rewards else f"none of them has {which} in modes {sft.modes}"
    fixes = [] if sft.min_reward is None else [f"lower --min-reward (sft.min_reward, now {sft.min_reward:g})"]
    if sft.modes == ["train"]:
        fixes.append("add --mode val")
    if not sft.include_failed:
        fixes.append("--include-failed")
    return (
        f"no attempt passes the filter (modes {sft.modes}, min_reward {sft.min_reward}); the store holds "
        f"{total} rollouts ({held}); {got}; to train on more: {', '.join(fixes) or 'record better rollouts'}"
    )


def split_tasks(tasks: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Attempt indices (train, val): whole tasks held out, chosen by a seeded shuffle of the distinct tasks;
    at least one task trains. Deterministic for a seed and the same data."""
    distinct = sorted(set(tasks))
    random.Random(seed).shuffle(distinct)
    n_val = min(math.ceil(val_fraction * len(distinct)), len(distinct) - 1) if val_fraction > 0 else 0
    held = set(distinct[:n_val])
    train = [i for i, t in enumerate(tasks) if t not in held]
    val = [i for i, t in enumerate(tasks) if t in held]
    return train, val


def _batch(attempts: Sequence[list[Triplet]], cfg: TrainerConfig, pad: int) -> tuple[Batch, dict[str, int]]:
    batch, stats = build_batch(
        [t for attempt in attempts for t in attempt],
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        pad_token_id=pad,
    )
    return replace(batch, temperatures=None), stats  # the model's own NLL: logits at temperature 1
