"""Adapter: spans -> triplets with the identical and per_call strategies, on hand-built spans and a real
store; grouping by attempt and turn merging."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import structlog

from agentloop.adapter import (
    AdapterStats,
    group_by_attempt,
    merge_turns,
    spans_to_triplets,
    triplets_for_rollouts,
)
from agentloop.agent import emit_reward, rollout
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.types import AttemptedRollout, LLMCall, Log, Reward, Rollout, Span, Triplet

RID, AID = "ro-test", "at-test"


class _Trace:
    """Builds the spans of one attempt in sequence order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def _add(self, payload: Any) -> _Trace:
        self.spans.append(
            Span(rollout_id=RID, attempt_id=AID, sequence_id=len(self.spans) + 1, payload=payload)
        )
        return self

    def call(self, n: int = 2, error: str | None = None, version: int | None = 3) -> _Trace:
        ids = [] if error else list(range(10 * n, 10 * n + n))
        return self._add(
            LLMCall(
                prompt_ids=[1, 2, n] if not error else [1, 2, 3],
                response_ids=ids,
                response_logprobs=[-0.5] * len(ids),
                finish_reason="stop" if not error else None,
                weights_version=version,
                error=error,
                sampling={"temperature": 0.7, "top_p": 1.0},
            )
        )

    def reward(self, value: float, name: str | None = None) -> _Trace:
        return self._add(Reward(value=value, name=name))

    def log(self) -> _Trace:
        return self._add(Log(message="tool ran"))


def _rewards(spans: list[Span], **kwargs: Any) -> list[float | None]:
    return [t.reward for t in spans_to_triplets(spans, **kwargs).triplets]


def test_identical_gives_the_summed_reward_to_every_call() -> None:
    trace = _Trace().call(1).log().call(2).reward(0.25).call(3).reward(1.0, "final")
    result = spans_to_triplets(trace.spans)
    assert [t.reward for t in result.triplets] == [1.25, 1.25, 1.25]
    assert [t.response_ids for t in result.triplets] == [[10], [20, 21], [30, 31, 32]]
    assert result.triplets[1].response_mask == [1, 1] and result.triplets[1].response_logprobs == [-0.5, -0.5]
    assert (
        result.stats.model_dump()
        == AdapterStats(rollouts=1, spans=6, llm_calls=3, triplets=3, rewards=2).model_dump()
    )


def test_identical_with_one_reward_is_that_reward() -> None:
    assert _rewards(_Trace().call().call().reward(0.7).spans) == [0.7, 0.7]


def test_spans_are_ordered_by_sequence_id() -> None:
    trace = _Trace().call(1).call(2).reward(1.0)
    shuffled = [trace.spans[2], trace.spans[0], trace.spans[1]]
    result = spans_to_triplets(shuffled, strategy="per_call", discount=0.0)
    assert [t.metadata["call_index"] for t in result.triplets] == [0, 1]
    assert [t.reward for t in result.triplets] == [0.0, 1.0]


def test_per_call_without_discount_keeps_rewards_where_they_were_given() -> None:
    trace = _Trace().call().reward(0.1).call().call().reward(0.3).reward(1.0).call()
    # call 0 owns 0.1; call 1 nothing; call 2 owns 0.3 and the final 1.0; call 3 comes after the last reward
    assert _rewards(trace.spans, strategy="per_call", discount=0.0) == [0.1, 0.0, 1.3, 0.0]


def test_per_call_discount_flows_final_reward_back() -> None:
    trace = _Trace().call().reward(0.1).call().call().reward(1.0)
    got = _rewards(trace.spans, strategy="per_call", discount=0.5)
    assert got == pytest.approx([0.1 + 0.25, 0.5, 1.0])
    assert _rewards(trace.spans, strategy="per_call") == pytest.approx([1.1, 1.0, 1.0])  # discount 1.0


def test_per_call_reward_before_first_call_belongs_to_first_call() -> None:
    trace = _Trace().reward(0.5).call().call().reward(1.0)
    result = spans_to_triplets(trace.spans, strategy="per_call", discount=0.0)
    assert [t.reward for t in result.triplets] == [0.5, 1.0]
    assert result.stats.rewards_before_first_call == 1


def test_calls_without_ids_are_counted_and_logged() -> None:
    trace = _Trace().call(1).call(error="context_length_exceeded").call(2).reward(1.0)
    trace.spans.append(
        Span(rollout_id=RID, attempt_id=AID, sequence_id=5, payload=LLMCall(prompt_ids=[], response_ids=[]))
    )
    with structlog.testing.capture_logs() as logs:
        result = spans_to_triplets(trace.spans)
    assert len(result.triplets) == 2
    assert result.stats.llm_calls == 4 and result.stats.calls_without_ids == 2
    assert [(c["sequence_id"], c["call_index"], c["reason"]) for c in result.stats.skipped_calls] == [
        (2, 1, "context_length_exceeded"),
        (5, 3, "empty prompt_ids"),
    ]
    (event,) = [e for e in logs if e["event"] == "llm_calls_without_token_ids"]
    assert event["log_level"] == "warning" and event["count"] == 2
    # the skipped call still counts as a turn for per-call discounting
    assert _rewards(trace.spans, strategy="per_call", discount=0.5) == [0.25, 1.0]


def test_no_reward_gives_none_and_is_counted() -> None:
    with structlog.testing.capture_logs() as logs:
        result = spans_to_triplets(_Trace().call().call().spans)
    assert [t.reward for t in result.triplets] == [None, None]
    assert result.stats.attempts_without_reward == 1
    assert any(e["event"] == "attempt_without_reward" for e in logs)


def test_metadata_carries_ids_and_rollout_input() -> None:
    trace = _Trace().call(version=7).reward(1.0)
    ro = Rollout(rollout_id=RID, input={"question": "2+2"}, mode="val")
    (triplet,) = spans_to_triplets(trace.spans, rollout=ro).triplets
    assert triplet.metadata == {
        "rollout_id": RID,
        "attempt_id": AID,
        "sequence_id": 1,
        "call_index": 0,
        "num_calls": 1,
        "weights_version": 7,
        "newest_weights_version": 7,
        "finish_reason": "stop",
        "attempt_reward": 1.0,  # the attempt's total: its one vote in a GRPO group
        "call_reward": 1.0,  # the call's own reward: what GAE places on its last token
        "temperature": 0.7,  # what the trainer computes log-probs at
        "call_id": 1,  # the span has none (recorded before call ids): call_index + 1
        "parent_call_id": None,  # a root
        "branch": "main",
        "input": {"question": "2+2"},
        "mode": "val",
    }
    json.dumps(triplet.metadata)  # travels as JSON


def test_bad_input_is_rejected_with_clear_errors() -> None:
    spans = _Trace().call().reward(1.0).spans
    with pytest.raises(ValueError, match=r"strategy must be one of \['identical', 'per_call'\], got 'sum'"):
        spans_to_triplets(spans, strategy="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"discount must be a number in \[0, 1\], got 1.5"):
        spans_to_triplets(spans, discount=1.5)
    with pytest.raises(TypeError, match="spans must be a list of Span"):
        spans_to_triplets("spans")  # type: ignore[arg-type]
    other = Span(rollout_id="ro-other", attempt_id=AID, sequence_id=9, payload=Log(message="x"))
    with pytest.raises(ValueError, match="spans must come from one attempt, got 2"):
        spans_to_triplets([*spans, other])
    unnumbered = Span(rollout_id=RID, attempt_id=AID, payload=Log(message="x"))
    with pytest.raises(ValueError, match="no sequence_id"):
        spans_to_triplets([*spans, unnumbered])
    with pytest.raises(ValueError, match=r"repeat sequence ids: \[1\]"):
        spans_to_triplets([spans[0], spans[0]])
    assert spans_to_triplets([]).triplets == []


async def test_triplets_for_rollouts_from_a_real_store() -> None:
    store = MemoryStore()

    @rollout
    async def agent(task: dict[str, Any], llm: Any, rollout: AttemptedRollout) -> float | None:
        if task["fail"]:
            raise RuntimeError("no triplets from me")
        for turn in range(2):  # what the proxy records on each LLM call
            await store.add_span(
                Span(
                    rollout_id=rollout.rollout_id,
                    attempt_id=rollout.attempt.attempt_id,
                    payload=LLMCall(prompt_ids=[1, turn], response_ids=[5 + turn], response_logprobs=[-0.1]),
                )
            )
            await emit_reward(0.5)
        return None

    good = await store.enqueue_rollout({"fail": False})
    bad = await store.enqueue_rollout({"fail": True})
    with anyio.fail_after(5):
        await Runner(agent, store, concurrency=2).run(max_rollouts=2)
    result = await triplets_for_rollouts(
        store, [good.rollout_id, bad.rollout_id], strategy="per_call", discount=0.0
    )
    assert [t.reward for t in result.triplets] == [0.5, 0.5]
    assert [t.prompt_ids for t in result.triplets] == [[1, 0], [1, 1]]
    assert all(t.metadata["input"] == {"fail": False} for t in result.triplets)
    assert (result.stats.rollouts, result.stats.rollouts_skipped, result.stats.triplets) == (1, 1, 2)
    identical = await triplets_for_rollouts(store, [good.rollout_id])
    assert [t.reward for t in identical.triplets] == [1.0, 1.0]


# ---------------------------------------------------------------- grouping by attempt, turn merging

ATT = {"rollout_id": "r", "attempt_id": "a"}


def _trip(prompt: list[int], resp: list[int], reward: float | None = 1.0, **kw: Any) -> Triplet:
    kw.setdefault("metadata", ATT)
    return Triplet(prompt_ids=prompt, response_ids=resp, reward=reward, **kw)


def test_group_by_attempt_names_the_attempt_else_the_rollout_else_each_alone() -> None:
    triplets = [
        _trip([1], [2], metadata={"rollout_id": "r", "attempt_id": "a"}),
        _trip([1], [2], metadata={"rollout_id": "r", "attempt_id": "b"}),
        _trip([1], [2], metadata={"rollout_id": "s"}),
        _trip([1], [2], metadata={}),
        _trip([1], [2], metadata={"rollout_id": "r", "attempt_id": "a"}),
        _trip([1], [2], metadata={"rollout_id": "s"}),
        _trip([1], [2], metadata={}),
    ]
    assert group_by_attempt(triplets) == [[0, 4], [1], [2, 5], [3], [6]]
    assert group_by_attempt([]) == []
    with pytest.raises(
        TypeError, match=r"takes agentloop\.types\.Triplet objects, got NoneType at position 1"
    ):
        group_by_attempt([triplets[0], None])  # type: ignore[list-item]


def test_merge_turns_masks_the_tokens_the_model_did_not_produce() -> None:
    calls = [
        _trip(
            [1, 2], [3, 4], None, response_logprobs=[-0.3, -0.4], metadata={**ATT, "call": 0, "input": "x"}
        ),
        # prompt = previous prompt + response + tool output [5, 6]
        _trip(
            [1, 2, 3, 4, 5, 6],
            [7, 8],
            1.0,
            response_logprobs=[-0.7, -0.8],
            response_mask=[1, 0],
            metadata={**ATT, "call": 1},
        ),
        _trip([1, 2, 3, 4, 5, 6, 7, 8], [10], None, response_logprobs=[-0.1], metadata={**ATT, "call": 2}),
        _trip([9, 9], [11], 0.5, response_logprobs=[-0.2]),  # does not extend: a new sample
    ]
    merged = merge_turns(calls)
    assert len(merged) == 2
    first, second = merged
    assert first.prompt_ids == [1, 2]
    assert first.response_ids == [3, 4, 5, 6, 7, 8, 10]
    assert first.response_mask == [1, 1, 0, 0, 1, 0, 1]
    assert first.response_logprobs == [-0.3, -0.4, 0.0, 0.0, -0.7, 0.0, -0.1]
    assert first.reward == 1.0  # the last reward that was not None
    calls_meta = [{"start": 0, "length": 2, "reward": 0.0, "source": 0}]
    calls_meta += [{"start": 4, "length": 2, "reward": 1.0, "source": 1}]
    calls_meta.append({"start": 6, "length": 1, "reward": 0.0, "source": 2})
    assert first.metadata == {**ATT, "call": 2, "input": "x", "merged_calls": 3, "calls": calls_meta}
    assert (second.prompt_ids, second.response_ids, second.reward) == ([9, 9], [11], 0.5)
    assert second.metadata["merged_calls"] == 1


def test_merge_turns_merges_within_each_attempt_only() -> None:
    other = {"rollout_id": "r", "attempt_id": "b"}
    calls = [
        _trip([1], [2]),
        _trip([1], [2], metadata=other),
        _trip([1, 2, 3], [4]),  # extends attempt a's first call, not b's (which comes in between)
        _trip([1, 2, 5], [6], metadata=other),
    ]
    merged = merge_turns(calls)
    assert [(t.metadata["attempt_id"], t.response_ids) for t in merged] == [
        ("a", [2, 3, 4]),
        ("b", [2, 5, 6]),
    ]
    # calls without an attempt stand alone: nothing to merge them with
    assert len(merge_turns([_trip([1], [2], metadata={}), _trip([1, 2], [3], metadata={})])) == 2


def test_versions_oldest_and_newest_per_call_and_per_merged_attempt() -> None:
    """issue 20: a call whose tokens span weights (an inflight update) is as stale as its oldest
    token; a merged attempt as its first call's oldest, and as new as its last call's newest."""
    trace = _Trace().call(version=5)
    first = trace.spans[0].payload
    assert isinstance(first, LLMCall)
    trace.spans[0] = trace.spans[0].model_copy(
        update={"payload": first.model_copy(update={"weights_version": 6, "response_versions": [5, 6]})}
    )
    trace.call(n=3, version=7).reward(1.0)
    calls = spans_to_triplets(trace.spans).triplets
    assert [(t.metadata["weights_version"], t.metadata["newest_weights_version"]) for t in calls] == [
        (5, 6),
        (7, 7),
    ]
    second = calls[1].model_copy(  # made to extend the first call: its prompt and its parent
        update={
            "prompt_ids": [*calls[0].prompt_ids, *calls[0].response_ids, 9],
            "metadata": {**calls[1].metadata, "parent_call_id": 1},
        }
    )
    (merged,) = merge_turns([calls[0], second])
    assert (merged.metadata["weights_version"], merged.metadata["newest_weights_version"]) == (5, 7)


def test_merge_turns_edge_cases() -> None:
    assert merge_turns([]) == []
    # a call without logprobs makes the merged sample's logprobs unknown
    merged = merge_turns([_trip([1], [2], response_logprobs=[-1.0]), _trip([1, 2], [3])])
    assert len(merged) == 1 and merged[0].response_logprobs is None and merged[0].response_ids == [2, 3]
    # a prompt that diverges inside the earlier response starts a new sample
    assert len(merge_turns([_trip([1], [2, 3]), _trip([1, 2, 4], [5])])) == 2
    with pytest.raises(TypeError, match=r"takes agentloop\.types\.Triplet objects"):
        merge_turns([None])  # type: ignore[list-item]


def test_rewards_out_of_range_are_refused_and_a_nonfinite_sum_drops_the_attempt() -> None:
    """Issue 44 finding 1: two rewards of 1.7e308 summed to inf and the sample build raised, which took
    ``serve --train`` down. Rewards are bounded (MAX_ABS_REWARD); a sum that is still not finite (spans
    built past validation) leaves the attempt out, counted, instead of raising."""
    from pydantic import ValidationError

    from agentloop.types import MAX_ABS_REWARD

    with pytest.raises(ValidationError, match=r"within \+-1e\+06 \(MAX_ABS_REWARD\), got 1.7e\+308"):
        Reward(value=1.7e308)
    assert Reward(value=MAX_ABS_REWARD).value == 1e6
    call = LLMCall(prompt_ids=[1, 2], response_ids=[3])
    huge = Reward.model_construct(kind="reward", value=1.7e308, name=None)
    spans = [
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, payload=call),
        Span.model_construct(
            rollout_id="ro-1", attempt_id="at-1", sequence_id=2, payload=huge, timestamp=0.0
        ),
        Span.model_construct(
            rollout_id="ro-1", attempt_id="at-1", sequence_id=3, payload=huge, timestamp=0.0
        ),
    ]
    out = spans_to_triplets(spans)
    assert out.triplets == [] and out.stats.attempts_nonfinite_reward == 1


def test_a_malformed_tool_call_is_flagged_for_the_trainers_count() -> None:
    """issue 46: the proxy logs "failed to decode tool call" at debug; the step's metrics count them
    (rollout/tool_call_parse_errors, from this flag)."""
    trace = _Trace().call(2).call(3).reward(1.0)
    payload = trace.spans[1].payload
    assert isinstance(payload, LLMCall)
    trace.spans[1] = trace.spans[1].model_copy(
        update={"payload": payload.model_copy(update={"tool_call_parse_error": True})}
    )
    first, second = spans_to_triplets(trace.spans).triplets
    assert "tool_call_parse_error" not in first.metadata and second.metadata["tool_call_parse_error"] is True
