"""Triplets -> padded batches: layout, masks, groups, drops, trajectory merging, micro/mini-batches."""

from __future__ import annotations

import pytest
import torch

from agentloop.errors import AgentLoopError, EmptyBatchError
from agentloop.types import Triplet
from trainer.batch import Batch, build_batch
from trainer.batch.splits import split_by_token_budget

PAD = 0


def trip(prompt: list[int], resp: list[int], reward: float | None = 1.0, **kw: object) -> Triplet:
    return Triplet(prompt_ids=prompt, response_ids=resp, reward=reward, **kw)  # type: ignore[arg-type]


def test_layout_left_padded_prompts_right_padded_responses() -> None:
    triplets = [
        trip([11, 12, 13], [21, 22], 1.0, response_logprobs=[-0.1, -0.2], metadata={"input": {"q": "a"}}),
        trip(
            [14],
            [23, 24, 25],
            0.0,
            response_logprobs=[-0.3, -9.0, -0.5],
            response_mask=[1, 0, 1],
            metadata={"input": {"q": "b"}},
        ),
        trip([15, 16], [26], 0.5, response_logprobs=[-0.6], metadata={"input": {"q": "a"}, "k": 1}),
    ]
    batch, stats = build_batch(triplets, max_prompt_length=8, max_response_length=8)
    assert len(batch) == 3 and batch.prompt_length == 3 and batch.response_length == 3
    assert batch.input_ids.tolist() == [
        [11, 12, 13, 21, 22, PAD],
        [PAD, PAD, 14, 23, 24, 25],
        [PAD, 15, 16, 26, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 2, 2]]
    # 0 on padding and on the tool token (Triplet.response_mask); logprobs 0 where masked
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 1], [1, 0, 0]]
    assert batch.engine_logprobs is not None
    torch.testing.assert_close(
        batch.engine_logprobs, torch.tensor([[-0.1, -0.2, 0], [-0.3, 0, -0.5], [-0.6, 0, 0]])
    )
    assert batch.responses.tolist() == [[21, 22, PAD], [23, 24, 25], [26, PAD, PAD]]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert batch.group_ids.tolist() == [0, 1, 0]  # same input, same group
    assert batch.metadata[2] == {"input": {"q": "a"}, "k": 1}
    assert stats["num_samples"] == 3 and stats["ungrouped"] == 0


def test_groups_by_explicit_group_id_else_input_else_alone() -> None:
    triplets = [
        trip([1], [2], metadata={"group_id": "g", "input": 1}),
        trip([1], [2], metadata={"group_id": "g", "input": 2}),
        trip([1], [2], metadata={"input": {"b": 1, "a": 2}}),
        trip([1], [2], metadata={"input": {"a": 2, "b": 1}}),  # same input, other key order
        trip([1], [2]),
        trip([1], [2]),
    ]
    batch, stats = build_batch(triplets, max_prompt_length=4, max_response_length=4)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 3]
    assert stats["ungrouped"] == 2


def test_unusable_attempts_leave_whole_and_long_responses_are_truncated() -> None:
    def of(attempt: str, *args: object, **kw: object) -> Triplet:
        return trip(*args, metadata={"rollout_id": "r", "attempt_id": attempt, "input": "q"}, **kw)  # type: ignore[arg-type]

    triplets = [
        of("a", [1], [2], 1.0),
        of("a", [1, 2, 3, 4, 5], [6], 1.0),  # prompt too long: not trained, "a" keeps its vote
        of("b", [1], [2, 3, 4, 5, 6], 0.5, response_logprobs=[-1.0] * 5),  # response too long: truncated
        of("c", [], [2]),  # empty prompt
        of("d", [1], [2], reward=None),  # no reward
        of("e", [1], [2, 3], response_mask=[0, 0]),  # nothing the model produced: kept, trains nothing
        trip([7, 8], [9], 0.25, metadata={"finish_reason": "length"}),  # stopped by max_tokens: flagged
    ]
    batch, stats = build_batch(triplets, max_prompt_length=4, max_response_length=4)
    assert batch.responses.tolist() == [[2, 0, 0, 0], [2, 3, 4, 5], [2, 3, 0, 0], [9, 0, 0, 0]]
    assert batch.truncated is not None and batch.truncated.tolist() == [False, True, False, True]
    assert batch.rewards.tolist() == [1.0, 0.5, 1.0, 0.25]
    assert batch.engine_logprobs is None  # not every sample had logprobs
    assert stats == {
        "num_triplets": 7,
        "num_samples": 4,
        "num_attempts": 4,
        "calls_prompt_too_long": 1,
        "attempts_untrained_prompt_too_long": 0,
        "dropped_attempts_empty": 1,
        "dropped_attempts_no_reward": 1,
        "dropped_attempts_nonfinite_reward": 0,
        "dropped_calls": 2,
        "truncated_samples": 2,
        "no_trainable_tokens": 1,
        "ungrouped": 1,
    }
    # the long call last: no tokens (length 0), in its attempt's vote at its place
    assert batch.calls is not None and batch.calls.source.tolist() == [0, 2, 5, 6, 1]
    assert batch.calls.length.tolist() == [1, 4, 2, 1, 0]  # the truncated call keeps its first 4 tokens
    assert batch.calls.attempt.tolist() == [0, 1, 2, 3, 0] and batch.calls.position.tolist() == [
        0,
        0,
        0,
        0,
        1,
    ]


def test_empty_batch_raises_only_when_asked() -> None:
    batch, stats = build_batch([trip([1, 2, 3], [4])], max_prompt_length=2, max_response_length=2)
    assert len(batch) == 0 and batch.input_ids.shape == (0, 0)
    assert stats["calls_prompt_too_long"] == 1 and stats["attempts_untrained_prompt_too_long"] == 1
    with pytest.raises(
        EmptyBatchError,
        match=r"no usable training sample out of 1 triplets .*is max_prompt_length large enough",
    ):
        build_batch([trip([1, 2, 3], [4])], max_prompt_length=2, max_response_length=2, require_nonempty=True)
    with pytest.raises(EmptyBatchError, match=r"out of 0 triplets .*did the agent call the LLM") as e:
        build_batch([], max_prompt_length=2, max_response_length=2, require_nonempty=True)
    assert isinstance(e.value, AgentLoopError)


def test_input_validation() -> None:
    with pytest.raises(TypeError, match=r"takes agentloop\.types\.Triplet objects, got dict"):
        build_batch([{"prompt_ids": [1]}], max_prompt_length=2, max_response_length=2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        build_batch([], max_prompt_length=0, max_response_length=2)


def test_engine_logprobs_absent_when_any_sample_lacks_them() -> None:
    triplets = [trip([1], [2], response_logprobs=[-1.0]), trip([1], [3])]
    batch, _ = build_batch(triplets, max_prompt_length=2, max_response_length=2)
    assert batch.engine_logprobs is None


# ---------------------------------------------------------------- trajectory mode


def test_merge_gives_one_row_per_merged_sample_each_call_in_its_place() -> None:
    att = {"rollout_id": "r", "attempt_id": "a"}
    calls = [
        trip([1, 2], [3, 4], 0.0, response_logprobs=[-0.3, -0.4], metadata={**att, "temperature": 0.5}),
        # prompt = previous prompt + response + tool output [5, 6]
        trip(
            [1, 2, 3, 4, 5, 6],
            [7, 8],
            1.0,
            response_logprobs=[-0.7, -0.8],
            response_mask=[1, 0],
            metadata=att,
        ),
        trip(
            [9], [11], 0.5, response_logprobs=[-0.2], metadata={**att, "finish_reason": "length"}
        ),  # new row
    ]
    batch, stats = build_batch(calls, max_prompt_length=6, max_response_length=8, merge=True)
    assert (len(batch), stats["num_attempts"]) == (2, 1)
    assert batch.responses.tolist() == [[3, 4, 5, 6, 7, 8], [11, PAD, PAD, PAD, PAD, PAD]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert batch.temperatures is not None and batch.truncated is not None and batch.calls is not None
    assert batch.temperatures[0].tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 1.0]  # tool tokens: 1
    assert batch.truncated.tolist() == [False, True]
    assert batch.metadata[0] == {**att, "temperature": 0.5, "merged_calls": 2}
    assert batch.metadata[1] == {**att, "finish_reason": "length"}
    assert (batch.calls.row.tolist(), batch.calls.start.tolist()) == ([0, 0, 1], [0, 4, 0])
    assert (batch.calls.length.tolist(), batch.calls.source.tolist()) == ([2, 2, 1], [0, 1, 2])
    assert batch.calls.reward.tolist() == [0.0, 1.0, 0.5]
    assert batch.rewards.tolist() == [1.0, 0.5]


# ---------------------------------------------------------------- micro- and mini-batches


def _batch(lengths: list[tuple[int, int]]) -> Batch:
    triplets = [
        trip(
            list(range(100 * i + 1, 100 * i + 1 + p)),
            list(range(100 * i + 50, 100 * i + 50 + r)),
            float(i),
            response_logprobs=[-0.5] * r,
            metadata={"i": i},
        )
        for i, (p, r) in enumerate(lengths)
    ]
    return build_batch(triplets, max_prompt_length=64, max_response_length=64)[0]


def _row_tokens(b: Batch, i: int) -> list[int]:
    return b.input_ids[i][b.attention_mask[i].bool()].tolist()


def test_token_budget_micro_batches() -> None:
    lengths = [(3, 2), (10, 30), (2, 2), (4, 6), (5, 5), (1, 1)]  # totals 5, 40, 4, 10, 10, 2
    batch = _batch(lengths)
    micro = split_by_token_budget(batch, max_tokens=16)
    seen = sorted(m.metadata[j]["i"] for m in micro for j in range(len(m)))
    assert seen == list(range(6))  # every sample exactly once
    totals = [int(m.sequence_lengths().sum()) for m in micro]
    assert totals[0] == 40 and len(micro[0]) == 1  # longer than the budget: alone
    assert all(t <= 16 for t in totals[1:])
    for m in micro:  # rows keep their tokens, masks and rewards; padding columns are trimmed
        assert m.input_ids.shape[1] == m.prompt_length + m.response_length
        assert m.prompt_length == int(m.attention_mask[:, : m.prompt_length].sum(-1).max())
        for j in range(len(m)):
            i = m.metadata[j]["i"]
            _, r = lengths[i]
            assert _row_tokens(m, j) == _row_tokens(batch, i)
            assert m.response_mask[j].tolist() == [1] * r + [0] * (m.response_length - r)
            assert m.engine_logprobs is not None and m.engine_logprobs[j, :r].tolist() == [-0.5] * r
            assert m.rewards[j].item() == float(i)
    again = split_by_token_budget(batch, 16)  # deterministic
    assert [m.metadata for m in again] == [m.metadata for m in micro]
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        split_by_token_budget(batch, 0)


def test_token_budget_padded_counts_rows_times_width() -> None:
    batch = _batch([(1, 1), (1, 1), (6, 1), (1, 6)])  # packed: 2 + 2 + 7 + 7 = 18 tokens
    assert len(split_by_token_budget(batch, 18)) == 1
    padded = split_by_token_budget(batch, 18, padded=True)
    for m in padded:
        assert len(m) * m.input_ids.shape[1] <= 18 or len(m) == 1


def test_to_device_keeps_everything() -> None:
    batch = _batch([(2, 2), (1, 3)])
    batch.extras["x"] = torch.ones(2)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.prompt_length == batch.prompt_length
    assert moved.extras["x"].tolist() == [1.0, 1.0] and moved.metadata == batch.metadata


def test_token_budget_counts_a_shared_prompt_once() -> None:
    """shared_prompts=True: rows with the same prompt stay together and their prompt counts once."""
    prompts = {0: [11, 12, 13, 14, 15, 16], 1: [21, 22, 23], 2: [31, 32, 33, 34]}
    rows = [(0, 2), (1, 4), (0, 3), (2, 1), (1, 2), (0, 2), (2, 2), (1, 1)]  # (prompt, response length)
    triplets = [trip(prompts[g], [40 + i] * r, metadata={"i": i}) for i, (g, r) in enumerate(rows)]
    batch, _ = build_batch(triplets, max_prompt_length=8, max_response_length=8)
    # padded cost: distinct prompts x longest prompt + rows x longest response
    whole = split_by_token_budget(batch, 6 + 3 * 3, padded=True, shared_prompts=True)
    assert [sorted(m.metadata[j]["i"] for j in range(len(m))) for m in whole] == [
        [0, 2, 5],
        [1, 4, 7],
        [3, 6],
    ]
    # without sharing, the prompt group 0 alone costs 3 x (6 + 3) = 27 tokens: it is cut up
    assert len(split_by_token_budget(batch, 15, padded=True)) > 3
    # packed: each distinct prompt's tokens once plus the responses' own; prompt 2's rows cost 4 + 2 + 1
    packed = split_by_token_budget(batch, 4 + 3, shared_prompts=True)
    assert [sorted(m.metadata[j]["i"] for j in range(len(m))) for m in packed][-1] == [3, 6]


def test_merged_rows_are_budgeted_by_max_trajectory_length_and_never_cut_a_call_away() -> None:
    """Four calls of one attempt, each prompt = the last prompt + response + a tool token (99);
    max_prompt_length 8, max_response_length 4: a row holds at most 12 tokens. Calls 0-2 merge into one
    row (prompt [1, 2], response 10 11 99 12 13 99 14 15: 10 tokens). Call 3 would make it 13: it starts a
    new row from its own prompt, 11 tokens, over max_prompt_length: not trained, kept in the vote. Before,
    the merged row was cut at max_response_length (4 tokens): calls 1-3 trained nothing."""
    prompt: list[int] = [1, 2]
    triplets = []
    for k in range(4):
        response = [10 + 2 * k, 11 + 2 * k]
        meta = {"rollout_id": "r", "attempt_id": "a", "call_index": k, "input": "q"}
        triplets.append(trip(prompt, response, 1.0, metadata=meta))
        prompt = prompt + response + [99]
    batch, stats = build_batch(triplets, max_prompt_length=8, max_response_length=4, merge=True)
    assert batch.responses.tolist() == [[10, 11, 99, 12, 13, 99, 14, 15]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 1, 1, 0, 1, 1]]
    assert batch.truncated is not None and batch.truncated.tolist() == [False]
    assert batch.calls is not None
    assert batch.calls.start.tolist() == [0, 3, 6, 0] and batch.calls.length.tolist() == [2, 2, 2, 0]
    assert batch.calls.position.tolist() == [0, 1, 2, 3]
    assert stats["calls_prompt_too_long"] == 1 and stats["attempts_untrained_prompt_too_long"] == 0
    # a longer budget takes call 3 into the row as well
    more, _ = build_batch(triplets, max_prompt_length=8, max_response_length=4, merge=True, max_row_tokens=13)
    assert more.responses.tolist() == [[10, 11, 99, 12, 13, 99, 14, 15, 99, 16, 17]]
    with pytest.raises(ValueError, match=r"max_row_tokens \(11\) must be at least"):
        build_batch(triplets, max_prompt_length=8, max_response_length=4, max_row_tokens=11)


def test_a_branched_attempt_gives_a_row_per_branch_with_each_call_in_its_own_place() -> None:
    """Main call 1, a subagent's call A (a new conversation), main call 2 extending call 1: merged, the
    rows are [1, 2] and [A] (merge_turns by the call tree), and each call keeps its own reward, source
    and position (call_index, chronological: 1 -> 0, A -> 1, 2 -> 2)."""
    meta = {"rollout_id": "r", "attempt_id": "a", "input": "q"}
    triplets = [
        trip([1, 2], [10, 11], 0.1, metadata={**meta, "call_index": 0, "call_id": 1, "parent_call_id": None}),
        trip([50, 51], [60], 0.2, metadata={**meta, "call_index": 1, "call_id": 2, "parent_call_id": None}),
        trip(
            [1, 2, 10, 11, 99],
            [12],
            0.3,
            metadata={**meta, "call_index": 2, "call_id": 3, "parent_call_id": 1},
        ),
    ]
    batch, _ = build_batch(triplets, max_prompt_length=8, max_response_length=8, merge=True)
    assert batch.responses.tolist() == [[10, 11, 99, 12], [60, 0, 0, 0]]
    assert batch.calls is not None
    assert batch.calls.source.tolist() == [0, 2, 1] and batch.calls.row.tolist() == [0, 0, 1]
    assert batch.calls.start.tolist() == [0, 3, 0] and batch.calls.length.tolist() == [2, 1, 1]
    assert batch.calls.reward.tolist() == pytest.approx([0.1, 0.3, 0.2])
    assert batch.calls.position.tolist() == [0, 2, 1]


def test_non_finite_rewards_drop_their_attempt_with_a_count() -> None:
    """Issue 44 finding 1: a triplet built past validation with an infinite reward is left out and
    counted, never turned into advantages."""
    good = Triplet(prompt_ids=[1, 2], response_ids=[3], reward=1.0, metadata={"attempt_id": "a"})
    bad = Triplet.model_construct(
        prompt_ids=[1, 2], response_ids=[3], response_logprobs=None, response_mask=[1],
        reward=float("inf"), metadata={"attempt_id": "b"},
    )  # fmt: skip
    batch, stats = build_batch([good, bad], max_prompt_length=8, max_response_length=8)
    assert len(batch) == 1 and batch.rewards.tolist() == [1.0]
    assert stats["dropped_attempts_nonfinite_reward"] == 1 and stats["dropped_calls"] == 1
