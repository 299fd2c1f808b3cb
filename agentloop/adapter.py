"""Spans of a finished attempt -> training Triplets, one per LLM call, with credit assignment.

Strategies (``strategy=``):

- ``identical`` (default): every call gets the attempt's reward, the **sum of all its Reward
  spans** (with one reward, simply that reward; a returned value and emitted rewards add up).
- ``per_call``: each Reward span belongs to the LLM call before it (a reward emitted before the
  first call belongs to the first call). The *final* reward (the last Reward span) also flows
  back to the earlier calls, discounted: the call k calls before the final reward's call gets
  ``discount**k * final`` on top of its own rewards. ``discount=0`` keeps rewards strictly per call;
  ``discount=1`` (default) gives every earlier call the full final reward. Calls after the last
  reward get 0.

Every triplet's metadata names its attempt (``rollout_id``, ``attempt_id``, ``call_index``, ``num_calls``),
the attempt's total reward (``attempt_reward``: the sum of its Reward spans, whatever the strategy; the
trainer's group baselines give each attempt one vote with it) and the sampling ``temperature`` the call
was made with (the trainer computes log-probs at that temperature).

An attempt without any Reward span yields triplets with ``reward=None`` and is counted in
``stats.attempts_without_reward``. LLM calls without token ids (an error such as
``context_length_exceeded``, empty prompt or response ids) yield no triplet; they are counted in
``stats.calls_without_ids``, listed in ``stats.skipped_calls`` and logged, never dropped silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field

from agentloop.logging import get_logger
from agentloop.store.base import Store
from agentloop.types import LLMCall, Reward, Rollout, RolloutStatus, Span, Triplet

log = get_logger("agentloop.adapter")

__all__ = [
    "AdapterResult",
    "AdapterStats",
    "Strategy",
    "TraceAdapter",
    "spans_to_triplets",
    "triplets_for_rollouts",
]

Strategy = Literal["identical", "per_call"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


class AdapterStats(BaseModel):
    """Counts of what the adapter saw and what it could not turn into triplets."""

    rollouts: int = Field(default=0, description="Rollouts (attempts) adapted.")
    rollouts_skipped: int = Field(default=0, description="Rollouts passed in that had not succeeded.")
    spans: int = Field(default=0, description="Spans read.")
    llm_calls: int = Field(default=0, description="LLMCall spans read.")
    triplets: int = Field(default=0, description="Triplets produced.")
    calls_without_ids: int = Field(
        default=0, description="LLM calls with no token ids to train on (no triplet)."
    )
    skipped_calls: list[dict[str, Any]] = Field(
        default_factory=list, description="Why each such call was skipped."
    )
    rewards: int = Field(default=0, description="Reward spans read.")
    rewards_before_first_call: int = Field(
        default=0, description="per_call: rewards given to the first call."
    )
    attempts_without_reward: int = Field(
        default=0, description="Attempts with no Reward span (triplets get None)."
    )

    def merge(self, other: AdapterStats) -> AdapterStats:
        """The element-wise sum of two stats."""
        data: dict[str, Any] = {}
        for name in type(self).model_fields:
            a, b = getattr(self, name), getattr(other, name)
            data[name] = a + b
        return AdapterStats(**data)


class AdapterResult(BaseModel):
    """Triplets in sequence order, and the stats of the conversion."""

    triplets: list[Triplet] = Field(default_factory=list)
    stats: AdapterStats = Field(default_factory=AdapterStats)


def _check_args(strategy: Any, discount: Any) -> float:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if isinstance(discount, bool) or not isinstance(discount, int | float) or not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be a number in [0, 1], got {discount!r}")
    return float(discount)


def _missing_ids(call: LLMCall) -> str | None:
    if call.error:
        return call.error
    if not call.prompt_ids:
        return "empty prompt_ids"
    if not call.response_ids:
        return "empty response_ids"
    return None


def _temperature(call: LLMCall) -> float | None:
    """The temperature the engine sampled this call at (None when the span does not say)."""
    value = call.sampling.get("temperature")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _ordered(spans: Sequence[Span | dict[str, Any]]) -> list[Span]:
    if isinstance(spans, str | bytes) or not isinstance(spans, Sequence):
        raise TypeError(f"spans must be a list of Span, got {type(spans).__name__}")
    parsed = [s if isinstance(s, Span) else Span.model_validate(s) for s in spans]
    attempts = {(s.rollout_id, s.attempt_id) for s in parsed}
    if len(attempts) > 1:
        raise ValueError(f"spans must come from one attempt, got {len(attempts)}: {sorted(attempts)[:3]}")
    unnumbered = [i for i, s in enumerate(parsed) if s.sequence_id is None]
    if unnumbered:
        raise ValueError(
            f"spans at positions {unnumbered[:5]} have no sequence_id; pass spans read from the store"
        )
    ordered = sorted(parsed, key=lambda s: s.sequence_id or 0)
    seqs = [s.sequence_id or 0 for s in ordered]
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"spans repeat sequence ids: {sorted({q for q in seqs if seqs.count(q) > 1})}")
    return ordered


def _assign(
    n_calls: int, rewards: list[tuple[int, float]], strategy: str, discount: float
) -> tuple[list[float | None], int]:
    """Rewards for each of ``n_calls`` calls; ``rewards`` holds (index of the call before it or -1, value)."""
    if not rewards:
        return [None] * n_calls, 0
    if strategy == "identical":
        total = sum(v for _, v in rewards)
        return [total] * n_calls, 0
    early = sum(1 for owner, _ in rewards if owner < 0)
    per_call: list[float | None] = [0.0] * n_calls
    *own, (final_owner, final) = [(max(owner, 0), v) for owner, v in rewards]
    for owner, value in own:
        if owner < n_calls:
            per_call[owner] = (per_call[owner] or 0.0) + value
    for i in range(min(final_owner, n_calls - 1) + 1):
        per_call[i] = (per_call[i] or 0.0) + discount ** (final_owner - i) * final
    return per_call, early


def spans_to_triplets(
    spans: Sequence[Span | dict[str, Any]],
    strategy: Strategy = "identical",
    discount: float = 1.0,
    rollout: Rollout | None = None,
) -> AdapterResult:
    """The LLM calls of one finished attempt as Triplets, in sequence order (see the module docstring).

    ``rollout`` (optional) adds its ``input`` and ``mode`` to each triplet's metadata, for grouping.
    """
    gamma = _check_args(strategy, discount)
    if rollout is not None and not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout or None, got {type(rollout).__name__}")
    ordered = _ordered(spans)
    calls: list[tuple[Span, LLMCall]] = []
    rewards: list[tuple[int, float]] = []
    for span in ordered:
        if isinstance(span.payload, LLMCall):
            calls.append((span, span.payload))
        elif isinstance(span.payload, Reward):
            rewards.append((len(calls) - 1, span.payload.value))
    values, early = _assign(len(calls), rewards, strategy, gamma)
    attempt_reward = sum(v for _, v in rewards) if rewards else None
    stats = AdapterStats(
        rollouts=1,
        spans=len(ordered),
        llm_calls=len(calls),
        rewards=len(rewards),
        rewards_before_first_call=early if calls else 0,
        attempts_without_reward=0 if rewards else 1,
    )
    triplets: list[Triplet] = []
    for index, ((span, call), reward) in enumerate(zip(calls, values, strict=True)):
        reason = _missing_ids(call)
        if reason is not None:
            stats.calls_without_ids += 1
            stats.skipped_calls.append(
                {
                    "rollout_id": span.rollout_id,
                    "attempt_id": span.attempt_id,
                    "sequence_id": span.sequence_id,
                    "call_index": index,
                    "reason": reason,
                }
            )
            continue
        meta: dict[str, Any] = {
            "rollout_id": span.rollout_id,
            "attempt_id": span.attempt_id,
            "sequence_id": span.sequence_id,
            "call_index": index,
            "num_calls": len(calls),
            "weights_version": call.weights_version,
            "finish_reason": call.finish_reason,
            "attempt_reward": attempt_reward,
            "temperature": _temperature(call),
        }
        if rollout is not None:
            meta["input"] = rollout.input
            meta["mode"] = rollout.mode
        triplets.append(
            Triplet(
                prompt_ids=call.prompt_ids,
                response_ids=call.response_ids,
                response_logprobs=call.response_logprobs,
                reward=reward,
                metadata=meta,
            )
        )
    stats.triplets = len(triplets)
    if stats.calls_without_ids:
        log.warning(
            "llm_calls_without_token_ids",
            rollout_id=ordered[0].rollout_id,
            attempt_id=ordered[0].attempt_id,
            count=stats.calls_without_ids,
            reasons=sorted({c["reason"] for c in stats.skipped_calls}),
        )
    if calls and not rewards:
        log.warning(
            "attempt_without_reward", rollout_id=ordered[0].rollout_id, attempt_id=ordered[0].attempt_id
        )
    return AdapterResult(triplets=triplets, stats=stats)


async def triplets_for_rollouts(
    store: Store, rollout_ids: Sequence[str], strategy: Strategy = "identical", discount: float = 1.0
) -> AdapterResult:
    """Triplets of the latest attempt of each succeeded rollout in ``rollout_ids`` (others are counted)."""
    _check_args(strategy, discount)
    if isinstance(rollout_ids, str) or not isinstance(rollout_ids, Sequence):
        raise TypeError(f"rollout_ids must be a list of ids, got {type(rollout_ids).__name__}")
    result = AdapterResult()
    for rid in rollout_ids:
        rollout = await store.get_rollout(rid)
        if rollout.status is not RolloutStatus.SUCCEEDED:
            result.stats.rollouts_skipped += 1
            continue
        spans = await store.query_spans(rid, "latest")
        one = spans_to_triplets(spans, strategy, discount, rollout=rollout)
        result.triplets.extend(one.triplets)
        result.stats = result.stats.merge(one.stats)
    return result


class TraceAdapter:
    """A strategy and discount, applied to spans or to rollouts in a store."""

    def __init__(self, strategy: Strategy = "identical", discount: float = 1.0) -> None:
        self.discount = _check_args(strategy, discount)
        self.strategy: Strategy = strategy

    def adapt(self, spans: Sequence[Span | dict[str, Any]], rollout: Rollout | None = None) -> AdapterResult:
        return spans_to_triplets(spans, self.strategy, self.discount, rollout=rollout)

    async def from_store(self, store: Store, rollout_ids: Sequence[str]) -> AdapterResult:
        return await triplets_for_rollouts(store, rollout_ids, self.strategy, self.discount)

    def __repr__(self) -> str:
        return f"TraceAdapter(strategy={self.strategy!r}, discount={self.discount})"
