"""How an attempt's triplets become a batch's rows (trainer/batch/__init__.py ``build_batch``): one row per call, or
consecutive calls of one attempt merged into one (``agentloop.adapter.merge_turns``), each row with its calls'
spans, rewards and sampling temperatures; the group an attempt belongs to; which calls make an attempt
unusable."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentloop.adapter import merge_turns
from agentloop.types import Triplet


def group_key(metadata: dict[str, Any]) -> str | None:
    if metadata.get("group_id") is not None:
        return f"id:{metadata['group_id']}"
    if "input" in metadata:
        text = json.dumps(metadata["input"], sort_keys=True, default=str)
        return "input:" + hashlib.sha1(text.encode()).hexdigest()
    return None


@dataclass
class Span:
    start: int  # first response column of the call's own tokens in its row
    length: int
    reward: float  # the call's return (the adapter's credit assignment)
    step_reward: float  # the call's own reward (``call_reward``): what GAE places on its last token
    source: int  # index in build_batch's input


@dataclass
class Row:
    """One sample: a call, or consecutive calls of one attempt merged (``agentloop.adapter.merge_turns``)."""

    sample: Triplet
    spans: list[Span]  # its calls, in order
    temps: list[float]  # the sampling temperature of each response token (1 on tool tokens)
    hit_max_tokens: bool  # a call the engine stopped at max_tokens
    metadata: dict[str, Any]  # the call's; merged: the first call's updated by the last's, + merged_calls


def attempt_rows(
    triplets: Sequence[Triplet],
    attempt: list[int],
    merge: bool,
    default_temperature: float,
    max_row_tokens: int | None = None,
) -> list[Row]:
    """The rows of one attempt's calls (positions ``attempt`` in ``triplets``, in order): one per call,
    or consecutive extending calls merged into one of at most ``max_row_tokens`` tokens."""
    calls = [triplets[i] for i in attempt]
    if merge:  # one sample per branch of the attempt's call tree; each call in exactly one
        samples = merge_turns(calls, max_row_tokens)
        places = [_places(s, attempt) for s in samples]
    else:
        samples = calls
        places = [[(0, len(t.response_ids), i)] for t, i in zip(calls, attempt, strict=True)]
    rows: list[Row] = []
    for sample, where in zip(samples, places, strict=True):
        temps = [1.0] * len(sample.response_ids)
        spans: list[Span] = []
        for start, length, i in where:
            temps[start : start + length] = [_temperature(triplets[i], default_temperature)] * length
            spans.append(
                Span(
                    start, length, triplet_reward(triplets[i]), _step_reward(triplets[i], i == attempt[-1]), i
                )
            )
        first, last = triplets[spans[0].source].metadata, triplets[spans[-1].source].metadata
        rows.append(
            Row(
                sample=sample,
                spans=spans,
                temps=temps,
                hit_max_tokens=any(
                    triplets[c.source].metadata.get("finish_reason") == "length" for c in spans
                ),
                metadata=dict(first) if len(spans) == 1 else {**first, **last, "merged_calls": len(spans)},
            )
        )
    return rows


def call_positions(triplets: Sequence[Triplet], attempt: list[int]) -> dict[int, int]:
    """Each call's place in its attempt (positions ``attempt`` in ``triplets``, in order): the adapter's
    ``call_index`` (calls that failed before it still count), else the calls' order."""
    indices = [triplets[i].metadata.get("call_index") for i in attempt]
    if all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in indices) and len(
        set(indices)
    ) == len(indices):
        return dict(zip(attempt, indices, strict=True))  # type: ignore[arg-type]
    return {i: k for k, i in enumerate(attempt)}


def _places(merged: Triplet, attempt: list[int]) -> list[tuple[int, int, int]]:
    """(start, length, index in build_batch's input) of each call's response in a sample from
    merge_turns (``metadata["calls"]``; ``source`` is the call's place in ``attempt``)."""
    calls: Any = merged.metadata["calls"]
    return [(int(c["start"]), int(c["length"]), attempt[int(c["source"])]) for c in calls]


def _temperature(t: Triplet, default: float) -> float:
    temp = t.metadata.get("temperature")
    return float(temp) if isinstance(temp, int | float) else default


def triplet_reward(t: Triplet) -> float:
    """The triplet's reward (the adapter's credit assignment: the call's return), 0 when it has none."""
    return float(t.reward) if t.reward is not None else 0.0


def _step_reward(t: Triplet, last_call: bool) -> float:
    """The call's own reward: the adapter's ``call_reward``; for triplets without it (built by hand),
    the reward on the attempt's last call and 0 on the others (either strategy gives the last call
    the attempt's return)."""
    own = t.metadata.get("call_reward")
    if isinstance(own, int | float):
        return float(own)
    return triplet_reward(t) if last_call else 0.0


def unusable(t: Triplet) -> str | None:
    """Why a call makes its whole attempt unusable (None when it is fine). A prompt over the limit is
    not one: that call is not trained, and its attempt keeps its vote and its other calls."""
    if not t.prompt_ids or not t.response_ids:
        return "dropped_attempts_empty"
    if t.reward is None:
        return "dropped_attempts_no_reward"
    values = (t.reward, t.metadata.get("attempt_reward"), t.metadata.get("call_reward"))
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):  # built past validation
        return "dropped_attempts_nonfinite_reward"
    return None
