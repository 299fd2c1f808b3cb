"""Spans of finished attempts -> training samples: Triplets with credit assignment, and turn merging.

``spans_to_triplets`` turns the spans of one attempt into Triplets, one per LLM call;
``triplets_for_rollouts`` does it for the latest attempt of each succeeded rollout in a store.
``group_by_attempt`` says which triplets belong to one attempt, and ``merge_turns`` merges each
branch of an attempt into one sample where each call extends the one before it (what the trainer's
``adapter.trajectory`` trains on, and what ``agentloop inspect`` shows).

Branches. One attempt can hold several conversations (subagents, compaction, side calls, forks): its
calls form a tree (``agentloop.call_tree``: each call's ``call_id``, ``parent_call_id`` and ``branch``).
Rewards follow time, not branches: a Reward span belongs to the call before it in time, and
``per_call``'s discount counts calls in time.

Strategies (``strategy=``):

- ``identical`` (default): every call gets the attempt's reward, the **sum of all its Reward
  spans** (with one reward, simply that reward; a returned value and emitted rewards add up).
- ``per_call``: each Reward span belongs to the LLM call before it (a reward emitted before the
  first call belongs to the first call). The *final* reward (the last Reward span) also flows
  back to the earlier calls, discounted: the call k calls before the final reward's call gets
  ``discount**k * final`` on top of its own rewards. ``discount=0`` keeps rewards strictly per call;
  ``discount=1`` (default) gives every earlier call the full final reward. Calls after the last
  reward get 0.

A reward that belongs to a call without token ids (it failed, e.g. ``context_length_exceeded``) moves to
the nearest earlier call that has them (else the first later one), under either strategy: no reward is
lost with a failed call.

Every triplet's metadata names its attempt (``rollout_id``, ``attempt_id``, ``call_index``: the call's
place among the attempt's calls in time, ``num_calls``), its place in the tree (``call_id``,
``parent_call_id``, ``branch``), the attempt's total reward (``attempt_reward``: the sum of its Reward spans, whatever the strategy; the
trainer's group baselines give each attempt one vote with it), the call's own reward (``call_reward``:
the Reward spans that follow it before the next call, whatever the strategy; a value model's GAE places
it on the call's last token and bootstraps across turns) and the sampling ``temperature`` the call was
made with (the trainer computes log-probs at that temperature).

An attempt without any Reward span yields triplets with ``reward=None`` and is counted in
``stats.attempts_without_reward``. LLM calls without token ids (an error such as
``context_length_exceeded``, empty prompt or response ids) yield no triplet; they are counted in
``stats.calls_without_ids``, listed in ``stats.skipped_calls`` and logged, never dropped silently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, Field

from agentloop.call_tree import Node, call_tree
from agentloop.logging import get_logger
from agentloop.types import LLMCall, Reward, Rollout, RolloutStatus, Span, Triplet

if TYPE_CHECKING:  # the trainer imports this module: keep the store backends out of its imports
    from agentloop.store.base import Store

log = get_logger("agentloop.adapter")

__all__ = [
    "AdapterResult",
    "AdapterStats",
    "Strategy",
    "group_by_attempt",
    "merge_turns",
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
    attempts_nonfinite_reward: int = Field(
        default=0, description="Attempts whose rewards summed to inf or NaN (no triplets; a bug upstream)."
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


def _owned_by_kept_calls(rewards: list[tuple[int, float]], kept: list[bool]) -> list[tuple[int, float]]:
    """Rewards whose call yields no triplet (it failed: no token ids) moved to the nearest earlier call
    that does (else the first later one), so that no reward is lost with its call: the reward of an
    attempt whose last call hit the context limit lands on the last token the attempt kept."""
    if all(kept) or not any(kept):
        return rewards
    moved: list[tuple[int, float]] = []
    for owner, value in rewards:
        at = max(owner, 0)
        if at < len(kept) and not kept[at]:
            earlier = [i for i in range(at) if kept[i]]
            at = earlier[-1] if earlier else kept.index(True)
            owner = at
        moved.append((owner, value))
    return moved


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
    calls, rewards = _calls_and_rewards(ordered)
    rewards = _owned_by_kept_calls(rewards, [_missing_ids(call) is None for _, call in calls])
    values, early = _assign(len(calls), rewards, strategy, gamma)
    attempt_reward = sum(v for _, v in rewards) if rewards else None
    own = _own_rewards(len(calls), rewards)
    stats = AdapterStats(
        rollouts=1,
        spans=len(ordered),
        llm_calls=len(calls),
        rewards=len(rewards),
        rewards_before_first_call=early if calls else 0,
        attempts_without_reward=0 if rewards else 1,
    )
    sums = [v for v in (*values, *own, attempt_reward) if v is not None]
    if not all(math.isfinite(v) for v in sums):  # Reward spans are bounded (MAX_ABS_REWARD): not from the API
        stats.attempts_nonfinite_reward = 1
        log.error(
            "attempt_nonfinite_reward", rollout_id=ordered[0].rollout_id, attempt_id=ordered[0].attempt_id,
            rewards=len(rewards), why="its rewards sum to inf or NaN; the attempt is left out of training",
        )  # fmt: skip
        return AdapterResult(triplets=[], stats=stats)
    tree = call_tree([call for _, call in calls])
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
        meta = _call_metadata(
            span,
            call,
            index,
            len(calls),
            attempt_reward,
            own[index] if rewards else None,
            tree[index],
            rollout,
        )
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
    _warn_incomplete(ordered, stats, has_calls=bool(calls), has_rewards=bool(rewards))
    return AdapterResult(triplets=triplets, stats=stats)


def _calls_and_rewards(ordered: list[Span]) -> tuple[list[tuple[Span, LLMCall]], list[tuple[int, float]]]:
    """The LLM calls (span, call) in order, and the rewards as (index of the call before it or -1, value)."""
    calls: list[tuple[Span, LLMCall]] = []
    rewards: list[tuple[int, float]] = []
    for span in ordered:
        if isinstance(span.payload, LLMCall):
            calls.append((span, span.payload))
        elif isinstance(span.payload, Reward):
            rewards.append((len(calls) - 1, span.payload.value))
    return calls, rewards


def _own_rewards(n_calls: int, rewards: list[tuple[int, float]]) -> list[float]:
    """Each call's own rewards (the Reward spans after it; any before the first call: the first's),
    whatever the strategy."""
    own = [0.0] * n_calls
    for owner, value in rewards:
        if n_calls:
            own[min(max(owner, 0), n_calls - 1)] += value
    return own


def _call_metadata(
    span: Span,
    call: LLMCall,
    index: int,
    num_calls: int,
    attempt_reward: float | None,
    call_reward: float | None,
    node: Node,
    rollout: Rollout | None,
) -> dict[str, Any]:
    """A call's triplet metadata: where it comes from, its weights versions, rewards and place in the tree."""
    meta: dict[str, Any] = {
        "rollout_id": span.rollout_id,
        "attempt_id": span.attempt_id,
        "sequence_id": span.sequence_id,
        "call_index": index,
        "num_calls": num_calls,
        # the oldest and newest weights that sampled a token (they differ across an inflight update)
        "weights_version": min(call.response_versions) if call.response_versions else call.weights_version,
        "newest_weights_version": max(call.response_versions)
        if call.response_versions
        else call.weights_version,
        "finish_reason": call.finish_reason,
        "attempt_reward": attempt_reward,
        "call_reward": call_reward,
        "temperature": _temperature(call),
        "call_id": node.call_id,
        "parent_call_id": node.parent_call_id,
        "branch": node.branch,
    }
    if call.tool_call_parse_error:  # the trainer counts them (rollout/tool_call_parse_errors)
        meta["tool_call_parse_error"] = True
    if rollout is not None:
        meta["input"] = rollout.input
        meta["mode"] = rollout.mode
    return meta


def _warn_incomplete(ordered: list[Span], stats: AdapterStats, *, has_calls: bool, has_rewards: bool) -> None:
    """Log the attempt's calls that had no token ids, and an attempt with calls but no reward."""
    if stats.calls_without_ids:
        log.warning(
            "llm_calls_without_token_ids",
            rollout_id=ordered[0].rollout_id,
            attempt_id=ordered[0].attempt_id,
            count=stats.calls_without_ids,
            reasons=sorted({c["reason"] for c in stats.skipped_calls}),
        )
    if has_calls and not has_rewards:
        log.warning(
            "attempt_without_reward", rollout_id=ordered[0].rollout_id, attempt_id=ordered[0].attempt_id
        )


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


def group_by_attempt(triplets: Sequence[Triplet]) -> list[list[int]]:
    """The positions of each attempt's triplets in ``triplets``, attempts in order of first appearance.

    A triplet belongs to the attempt its metadata names (``rollout_id`` + ``attempt_id``, as
    ``spans_to_triplets`` writes them), else to its rollout (``rollout_id``), else it stands alone.
    """
    attempts: dict[str, list[int]] = {}
    for i, t in enumerate(triplets):
        if not isinstance(t, Triplet):
            raise TypeError(
                f"the adapter takes agentloop.types.Triplet objects, got {type(t).__name__} at position {i}"
            )
        attempts.setdefault(_attempt_key(t.metadata, i), []).append(i)
    return list(attempts.values())


def _attempt_key(metadata: dict[str, Any], index: int) -> str:
    if metadata.get("attempt_id") is not None:
        return f"attempt:{metadata.get('rollout_id')}/{metadata['attempt_id']}"
    if metadata.get("rollout_id") is not None:
        return f"rollout:{metadata['rollout_id']}"
    return f"triplet:{index}"


def merge_turns(triplets: Sequence[Triplet], max_tokens: int | None = None) -> list[Triplet]:
    """Each branch of each attempt merged into one sample where each call extends the one before it.

    Calls are grouped by attempt (``group_by_attempt``; attempts in order of first appearance, calls in
    the order given). A call joins the sample of the call it extends: the one its ``parent_call_id``
    names (``spans_to_triplets`` writes it with ``call_id``), when that call is still the sample's last
    one and the prompt does start with the sample's tokens; a fork (a second call extending the same
    call, such as parallel tool branches) starts a new sample from its own prompt. A root, or a call
    without ids, joins the sample whose prompt + response its prompt starts with, the longest of the
    attempt's samples first; a subagent, a compaction or a side call extends none and starts its own.
    So main call 1, subagent call A, main call 2 give the samples [1, 2] and [A].

    Joining, the sample's response grows by the extra prompt tokens (tool results, chat template: mask
    0, logprob 0) and then the call's response (its own mask and logprobs). The sample's ``reward`` is
    its last call's non-None reward, and its logprobs are None when a call has none. Every call's own
    reward and place stay in ``metadata["calls"]`` (``start``, ``length``, ``reward``, and ``source``:
    the call's position in ``triplets``; one entry per call, in order): the trainer
    (``build_batch(merge=True)``) gives each call its own return. Samples come in the order of their
    first calls, so with several branches the calls of all samples, read in turn, are no longer in the
    order given: ``source`` says which each is. Metadata is otherwise the first call's updated by the
    last's, with ``merged_calls`` (the number of calls).

    ``max_tokens`` bounds a merged sample (prompt + response, tool tokens included): a call that would
    take it over starts a new sample from its own prompt (a single call longer than it stays whole).
    """
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    out: list[Triplet] = []
    for attempt in group_by_attempt(triplets):
        samples: list[_Merged] = []
        holder: dict[int, _Merged] = {}  # call_id -> the sample that holds the call (the latest such call)
        for i in attempt:
            t = triplets[i]
            fits = max_tokens is None or len(t.prompt_ids) + len(t.response_ids) <= max_tokens
            call_id, parent = _tree_ids(t)
            if call_id is not None and parent is not None:
                found = holder.get(parent)
                into = found if found is not None and found.last_id == parent and found.extends(t) else None
            else:  # a root, or no ids: the tokens decide (a ledger break whose full render came out the same)
                into = max(
                    (m for m in reversed(samples) if m.extends(t)), key=lambda m: m.length(), default=None
                )
            if into is not None and fits:
                into.add(t, i)
            else:
                into = _Merged(t, i)
                samples.append(into)
            if call_id is not None:
                holder[call_id] = into
        out.extend(s.triplet() for s in samples)
    return out


def _tree_ids(t: Triplet) -> tuple[int | None, int | None]:
    """The call's ``call_id`` and ``parent_call_id`` from its metadata (None where absent or not ints)."""

    def whole(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return whole(t.metadata.get("call_id")), whole(t.metadata.get("parent_call_id"))


class _Merged:
    """One sample under construction: consecutive calls of one attempt."""

    def __init__(self, t: Triplet, source: int) -> None:
        self.prompt = list(t.prompt_ids)
        self.resp = list(t.response_ids)
        self.mask = _call_mask(t)
        self.logp = _call_logp(t)
        self.calls: list[dict[str, Any]] = [
            {"start": 0, "length": len(t.response_ids), "reward": _reward(t), "source": source}
        ]
        self.reward = t.reward
        self.first_meta = t.metadata
        self.last_meta = t.metadata
        self.last_id = _tree_ids(t)[0]  # the call_id of the sample's last call

    def length(self) -> int:
        return len(self.prompt) + len(self.resp)

    def extends(self, t: Triplet) -> bool:
        n = self.length()
        return (
            len(t.prompt_ids) >= n
            and t.prompt_ids[: len(self.prompt)] == self.prompt
            and (t.prompt_ids[len(self.prompt) : n] == self.resp)
        )

    def add(self, t: Triplet, source: int) -> None:
        """Append call ``t`` (which extends this sample): the prompt delta (tool results, template) masked."""
        extra = t.prompt_ids[len(self.prompt) + len(self.resp) :]
        mask, logp = _call_mask(t), _call_logp(t)
        start = len(self.resp) + len(extra)
        self.calls.append(
            {"start": start, "length": len(t.response_ids), "reward": _reward(t), "source": source}
        )
        self.last_id = _tree_ids(t)[0]
        self.resp = self.resp + extra + list(t.response_ids)
        self.mask = self.mask + [0] * len(extra) + mask
        self.logp = None if self.logp is None or logp is None else self.logp + [0.0] * len(extra) + logp
        self.reward = t.reward if t.reward is not None else self.reward
        self.last_meta = t.metadata

    def triplet(self) -> Triplet:
        meta: dict[str, Any] = {**self.first_meta, **self.last_meta}
        # calls run in order: the first call holds the oldest weights' tokens, the last the newest's
        if "weights_version" in self.first_meta:
            meta["weights_version"] = self.first_meta["weights_version"]
        if "newest_weights_version" in self.last_meta:
            meta["newest_weights_version"] = self.last_meta["newest_weights_version"]
        meta["merged_calls"] = len(self.calls)
        meta["calls"] = self.calls
        return Triplet(
            prompt_ids=self.prompt,
            response_ids=self.resp,
            response_logprobs=self.logp,
            response_mask=self.mask,
            reward=self.reward,
            metadata=meta,
        )


def _call_mask(t: Triplet) -> list[int]:
    return list(t.response_mask) if t.response_mask is not None else [1] * len(t.response_ids)


def _call_logp(t: Triplet) -> list[float] | None:
    """The call's logprobs, 0 where its mask is 0."""
    if t.response_logprobs is None:
        return None
    return [lp if m else 0.0 for lp, m in zip(t.response_logprobs, _call_mask(t), strict=True)]


def _reward(t: Triplet) -> float:
    return float(t.reward) if t.reward is not None else 0.0
