"""Advantages per attempt (trainer/batch/advantages.py): each attempt votes once, merging changes nothing,
nothing removes part of an attempt. Every expected value is computed by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.errors import ConfigError
from agentloop.types import Triplet
from trainer import sample_advantages
from trainer.algorithms import agg_loss, attempt_row_weights
from trainer.batch import build_batch
from trainer.batch.advantages import batch_advantages
from trainer.config import TrainerConfig

# fp32 results against float64 expectations of size ~1 (advantages, IS weights <= 2), each a few
# operations and sums of <= 10 terms: a few ulps apart on any CPU; 64 eps (7.6e-6) leaves room
FP32_TOL = 64 * torch.finfo(torch.float32).eps


def attempt(
    name: str, rewards: list[float], task: str = "t", *, total: float | None = None, resp_len: int = 2
) -> list[Triplet]:
    """One attempt's calls; call k's prompt extends call k-1's prompt + response + a tool token (99)."""
    out: list[Triplet] = []
    prompt = [1, 2]
    for k, reward in enumerate(rewards):
        response = [10 + k] * resp_len
        out.append(
            Triplet(
                prompt_ids=list(prompt),
                response_ids=response,
                reward=reward,
                metadata={
                    "rollout_id": f"ro-{name}",
                    "attempt_id": f"at-{name}",
                    "input": {"task": task},
                    "attempt_reward": rewards[-1] if total is None else total,
                    "call_index": k,
                },
            )
        )
        prompt = prompt + response + [99]
    return out


def config(**algorithm: object) -> dict:
    trajectory = bool(algorithm.pop("trajectory", False))
    return {
        "algorithm": algorithm,
        "adapter": {"trajectory": trajectory},
        "data": {"max_prompt_length": 64, "max_response_length": 64},
    }


def std(values: list[float]) -> float:  # unbiased, as GRPO
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_an_attempt_with_many_calls_votes_once() -> None:
    """The issue's case: rewards 1.0 (5 calls), 0.5, 0, 0. Per call the 0.5 attempt got -0.41 (the
    1.0 attempt voted five times); per attempt it is above the mean and gets +0.26."""
    triplets = attempt("a", [1.0] * 5) + attempt("b", [0.5]) + attempt("c", [0.0]) + attempt("d", [0.0])
    adv = sample_advantages(triplets, config(adv_estimator="grpo"))
    votes = [1.0, 0.5, 0.0, 0.0]
    mean, s = sum(votes) / 4, std(votes)  # 0.375, 0.4787
    expected = [(1.0 - mean) / (s + 1e-6)] * 5 + [(v - mean) / (s + 1e-6) for v in votes[1:]]
    assert adv == pytest.approx(expected, abs=FP32_TOL)
    assert adv[5] == pytest.approx(0.2611, abs=1e-4)  # the 0.5 attempt is pushed up, not down


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_the_number_of_calls_of_one_attempt_does_not_change_the_others(estimator: str) -> None:
    others = attempt("b", [0.5]) + attempt("c", [0.0, 0.0, 0.0]) + attempt("d", [0.2, 0.2])
    few = sample_advantages(attempt("a", [1.0]) + others, config(adv_estimator=estimator))
    many = sample_advantages(attempt("a", [1.0] * 6) + others, config(adv_estimator=estimator))
    if estimator == "reinforce_plus_plus_baseline":  # whitened over the batch with attempt-equal weights
        assert few[1:] == pytest.approx(many[6:], abs=FP32_TOL)
    else:
        assert few[1:] == pytest.approx(many[6:], abs=FP32_TOL)
    assert len(set(many[:6])) == 1  # every call of the attempt gets the attempt's advantage


def test_rloo_leaves_one_attempt_out() -> None:
    triplets = attempt("a", [1.0, 1.0, 1.0]) + attempt("b", [0.0]) + attempt("c", [0.5])
    adv = sample_advantages(triplets, config(adv_estimator="rloo"))
    # a: 1 - (0 + 0.5) / 2 ; b: 0 - (1 + 0.5) / 2 ; c: 0.5 - (1 + 0) / 2
    assert adv == pytest.approx([0.75, 0.75, 0.75, -0.75, 0.0])


def test_merging_the_calls_of_an_attempt_changes_no_advantage() -> None:
    """per_call credit: call 0 earned 0.5 of its own plus the final 1.0 (adapter, discount 1), call 1
    the final 1.0. Merged into one row each call keeps its own return (before: the last one, 1.0)."""
    a = attempt("a", [1.5, 1.0], total=1.5)
    triplets = a + attempt("b", [0.0], total=0.0) + attempt("c", [1.0, 0.0], total=1.0)
    flat = sample_advantages(triplets, config(adv_estimator="grpo"))
    merged = sample_advantages(triplets, config(adv_estimator="grpo", trajectory=True))
    assert merged == pytest.approx(flat, abs=FP32_TOL)
    first = [1.5, 0.0, 1.0]  # the group at call 0
    second = [1.0, 0.0, 0.0]  # at call 1: b made one call and stands at its last return, 0
    expected = [
        (first[0] - sum(first) / 3) / (std(first) + 1e-6),
        (second[0] - sum(second) / 3) / (std(second) + 1e-6),  # (1 - 1/3) / sqrt(1/3) = 1.1547
    ]
    assert flat[:2] == pytest.approx(expected, abs=FP32_TOL)
    batch, _ = build_batch(a, max_prompt_length=64, max_response_length=64, merge=True)
    assert len(batch) == 1 and batch.calls is not None and batch.calls.reward.tolist() == [1.5, 1.0]


def test_long_responses_are_truncated_and_keep_their_vote() -> None:
    triplets = attempt("a", [1.0], resp_len=10) + attempt("b", [0.0]) + attempt("c", [0.0])
    cfg = config(adv_estimator="grpo")
    cfg["data"]["max_response_length"] = 4
    adv = sample_advantages(triplets, cfg)
    votes = [1.0, 0.0, 0.0]
    mean, s = sum(votes) / 3, std(votes)
    assert adv == pytest.approx([(v - mean) / (s + 1e-6) for v in votes], abs=FP32_TOL)
    # DAPO's overlong filter: the truncated sample trains nothing, the others keep their advantages
    cfg["algorithm"]["overlong_filter"] = True
    filtered = sample_advantages(triplets, cfg)
    assert filtered[0] is None and filtered[1:] == pytest.approx(adv[1:], abs=FP32_TOL)


def test_an_attempt_without_a_reward_leaves_whole_and_a_long_call_keeps_its_attempts_vote() -> None:
    """a's second call has a prompt over max_prompt_length: it is not trained (None), but a keeps its
    vote and its first call trains; e has no reward and leaves whole. Group a 1.0, b 0.5, c 0.0: mean
    0.5, std 0.5 -> a +1, b 0, c -1 (over std + 1e-6)."""
    long_prompt = attempt("a", [1.0, 1.0])
    long_prompt[1] = long_prompt[1].model_copy(update={"prompt_ids": [1] * 100})
    no_reward = [t.model_copy(update={"reward": None}) for t in attempt("e", [0.0])]
    triplets = long_prompt + attempt("b", [0.5]) + attempt("c", [0.0]) + no_reward
    adv = sample_advantages(triplets, config(adv_estimator="grpo"))
    votes = [1.0, 0.5, 0.0]
    mean, s = sum(votes) / 3, std(votes)
    assert adv[1] is None and adv[4] is None
    expected = [(v - mean) / (s + 1e-6) for v in votes]
    assert [adv[0], adv[2], adv[3]] == pytest.approx(expected, abs=FP32_TOL)


@pytest.mark.parametrize("trajectory", [False, True])
def test_a_long_failing_attempt_is_penalised_not_dropped(trajectory: bool) -> None:
    """Survivorship bias (issue 43): a short success (1 call, reward 1) and a long failure (3 calls,
    reward 0) whose third prompt, the grown conversation, is over max_prompt_length (64). That attempt
    left the batch whole, the success was alone in its group, and nothing trained. Now the long call is
    not trained and the failure votes: at every call the group is (1, 0), mean 0.5, std 0.7071 ->
    success +0.7071, the failure's first two calls -0.7071 and its third None. Merged
    (``adapter.trajectory``), the row's prompt is the first call's and the row (76 tokens) fits its
    budget (64 + 64): the third call trains too."""
    success = attempt("s", [1.0])
    failure = attempt("f", [0.0, 0.0, 0.0])
    failure[2] = failure[2].model_copy(update={"prompt_ids": failure[2].prompt_ids + [98] * 64})
    adv = sample_advantages(success + failure, config(adv_estimator="grpo", trajectory=trajectory))
    a = 0.5 / (std([1.0, 0.0]) + 1e-6)
    assert adv[:3] == pytest.approx([a, -a, -a], abs=FP32_TOL)
    assert adv[3] == (pytest.approx(-a, abs=FP32_TOL) if trajectory else None)


def test_tasks_are_separate_groups_and_a_lone_attempt_gets_zero() -> None:
    triplets = attempt("a", [1.0], task="x") + attempt("b", [0.0], task="x") + attempt("c", [1.0], task="y")
    adv = sample_advantages(triplets, config(adv_estimator="grpo"))
    assert adv[2] == 0.0 and adv[0] == pytest.approx(-adv[1])  # type: ignore[operator]


def test_sample_advantages_validates_its_input() -> None:
    with pytest.raises(TypeError, match="triplets must be a list of agentloop Triplet, got str"):
        sample_advantages("nope", {})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="use_kl_in_reward"):
        sample_advantages([], {"algorithm": {"use_kl_in_reward": True}})


def test_gae_is_refused_without_its_critic() -> None:
    with pytest.raises(ConfigError, match=r"adv_estimator='gae' estimates advantages with a value model"):
        TrainerConfig.from_dict({"algorithm": {"adv_estimator": "gae"}, "critic": {"enable": False}})


def test_attempt_mean_loss_weighs_attempts_equally() -> None:
    """Two attempts: one row of 1 token (loss 4), and two rows of 2 + 1 tokens (losses 1, 1, 7).
    Per attempt: 4 and (1 + 1 + 7) / 3 = 3; their mean is 3.5 (token-mean would give 13 / 4)."""
    loss = torch.tensor([[4.0, 0, 0], [1.0, 1.0, 0], [7.0, 0, 0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 0]])
    weights = attempt_row_weights(mask, torch.tensor([5, 9, 9]))
    assert weights.tolist() == pytest.approx([0.5, 1 / 6, 1 / 6])
    assert float(agg_loss(loss, mask, "attempt-mean-token-mean", row_weights=weights)) == pytest.approx(3.5)
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(13 / 4)
    # micro-batches with the mini-batch's weights add up to the whole
    parts = [
        agg_loss(loss[i : i + 1], mask[i : i + 1], "attempt-mean-token-mean", row_weights=weights[i : i + 1])
        for i in range(3)
    ]
    assert float(sum(parts)) == pytest.approx(3.5)


def test_batch_advantages_needs_the_built_batch() -> None:
    batch, _ = build_batch(attempt("a", [1.0]), max_prompt_length=8, max_response_length=8)
    with pytest.raises(ValueError, match="a selection has no calls"):
        batch_advantages(batch.select([0]), TrainerConfig())


def test_reward_mean_is_per_attempt_not_per_call() -> None:
    from trainer.fit.train_step import attempt_metrics

    triplets = attempt("a", [1.0] * 5) + attempt("b", [0.0])  # per call the mean would be 5 / 6
    metrics = attempt_metrics(triplets)
    assert metrics["reward/mean"] == 0.5 and metrics["rollout/calls_per_attempt"] == 3.0


def spans_attempt(name: str, events: list[tuple], task: str = "t", **adapter: object) -> list[Triplet]:
    """An attempt through the real adapter: events are ("call", prompt, response), ("fail",) for a
    call that hit the context limit (no ids), or ("reward", value)."""
    from agentloop.adapter import spans_to_triplets
    from agentloop.types import LLMCall, Reward, Rollout, Span

    payloads: list[LLMCall | Reward] = []
    for event in events:
        if event[0] == "call":
            payloads.append(
                LLMCall(prompt_ids=event[1], response_ids=event[2], response_logprobs=[-1.0] * len(event[2]))
            )
        elif event[0] == "fail":
            payloads.append(LLMCall(prompt_ids=[1] * 300, error="context_length_exceeded"))
        else:
            payloads.append(Reward(value=event[1]))
    spans = [
        Span(rollout_id=name, attempt_id=f"{name}-1", sequence_id=i, payload=p)
        for i, p in enumerate(payloads, start=1)
    ]
    rollout = Rollout(rollout_id=name, input={"task": task})
    return spans_to_triplets(spans, rollout=rollout, **adapter).triplets  # type: ignore[arg-type]


def two_calls(name: str, after_first: float, at_end: float) -> list[Triplet]:
    return spans_attempt(
        name,
        [
            ("call", [1, 2, 3], [10, 11]),
            ("reward", after_first),
            ("call", [1, 2, 3, 10, 11, 4], [12, 13]),
            ("reward", at_end),
        ],
        strategy="per_call",
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("trajectory", [False, True])
def test_per_call_credit_gives_a_group_with_equal_outcomes_zero(estimator: str, trajectory: bool) -> None:
    """GRPO's contract (Shao et al. 2024; verl ``compute_grpo_outcome_advantage``): a group whose
    attempts all did the same learns nothing. Two attempts each earn +0.5 after call 1 and +0.5 at the
    end; per_call returns (discount 1) are [1.0, 0.5] for both. Call 2's return 0.5 was compared with
    the attempts' totals 1.0 over a std of 0: -500000."""
    triplets = two_calls("a", 0.5, 0.5) + two_calls("b", 0.5, 0.5)
    assert [t.reward for t in triplets] == [1.0, 0.5, 1.0, 0.5]
    adv = sample_advantages(triplets, config(adv_estimator=estimator, trajectory=trajectory))
    assert adv == [0.0, 0.0, 0.0, 0.0]


def test_per_call_credit_compares_each_call_with_the_group_at_the_same_call() -> None:
    """Totals 1.0 vs 0.9 (+0.5 then +0.5, against +0.5 then +0.4). Returns by call: a [1.0, 0.5],
    b [0.9, 0.4]. Call 1: mean 0.95, std sqrt(2 * 0.05^2 / 1) = 0.0707 -> +-0.7071; call 2: mean 0.45,
    the same std -> +-0.7071. The better attempt's second call was -6.36 (compared with totals)."""
    triplets = two_calls("a", 0.5, 0.5) + two_calls("b", 0.5, 0.4)
    adv = sample_advantages(triplets, config(adv_estimator="grpo"))
    s = std([1.0, 0.9])  # = std([0.5, 0.4]) in exact arithmetic
    # the scores are fp32 ~1 whose differences are 0.1: relative rounding 8 eps / 0.1
    tol = 8 * torch.finfo(torch.float32).eps / 0.1
    assert adv == pytest.approx(
        [0.05 / (s + 1e-6), 0.05 / (s + 1e-6), -0.05 / (s + 1e-6), -0.05 / (s + 1e-6)], abs=tol
    )
    assert adv[1] == pytest.approx(0.7071, abs=1e-4)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_per_call_credit_rewards_the_call_that_earned_the_later_reward(estimator: str) -> None:
    """Equal totals, different timing: a earns +1 after call 1 and 0 at the end, b 0 then +1.
    Returns (discount 1): a [1, 0], b [1, 1]. Call 1 is a tie (0); at call 2, a's return 0 against b's
    1: GRPO -+0.5 / std(0, 1) = -+0.7071, RLOO 0 - 1 = -1 and 1 - 0 = +1. Identical credit gives all 0
    (equal totals); comparing call returns with totals gave a's second call -1e6."""
    triplets = two_calls("a", 1.0, 0.0) + two_calls("b", 0.0, 1.0)
    assert [t.reward for t in triplets] == [1.0, 0.0, 1.0, 1.0]
    adv = sample_advantages(triplets, config(adv_estimator=estimator))
    second = 0.5 / (std([0.0, 1.0]) + 1e-6) if estimator == "grpo" else 1.0
    assert adv == pytest.approx([0.0, -second, 0.0, second], abs=FP32_TOL)


def test_per_call_credit_an_attempt_that_ended_stands_at_its_last_return() -> None:
    """a makes three calls (+0.2 after the first, +1 at the end: returns 1.2, 1, 1 with discount 1),
    b one call rewarded 0. At call 1 the group is [1.2, 0]; at calls 2 and 3 b stands at its last
    return 0: [1, 0]. RLOO: a 1.2, 1, 1; b -1.2. With one final reward only and discount 1, per_call
    equals identical credit whatever the lengths (the second case)."""
    a = spans_attempt(
        "a",
        [
            ("call", [1], [10]),
            ("reward", 0.2),
            ("call", [1, 10, 4], [11]),
            ("call", [1, 10, 4, 11, 4], [12]),
            ("reward", 1.0),
        ],
        strategy="per_call",
    )
    b = spans_attempt("b", [("call", [1], [13]), ("reward", 0.0)], strategy="per_call")
    assert [t.reward for t in a + b] == [1.2, 1.0, 1.0, 0.0]
    assert sample_advantages(a + b, config(adv_estimator="rloo")) == pytest.approx(
        [1.2, 1.0, 1.0, -1.2], abs=FP32_TOL
    )
    c = spans_attempt(
        "c",
        [("call", [1], [10]), ("call", [1, 10, 4], [11]), ("call", [1, 10, 4, 11, 4], [12]), ("reward", 1.0)],
        strategy="per_call",
    )
    d = spans_attempt("d", [("call", [1], [13]), ("reward", 0.25)], strategy="per_call")
    identical = [t.model_copy(update={"reward": t.metadata["attempt_reward"]}) for t in c + d]
    for estimator in ("grpo", "rloo"):
        assert sample_advantages(c + d, config(adv_estimator=estimator)) == sample_advantages(
            identical, config(adv_estimator=estimator)
        )


def test_grpo_with_kl_in_reward_takes_the_group_statistics_on_the_penalised_scores() -> None:
    """verl (``apply_kl_penalty`` then ``compute_grpo_outcome_advantage``): token rewards minus
    beta * KL, summed to a score, and GRPO over those scores. Both attempts earn 1.0; KL sums 0.6 and
    0.15, beta 0.1: scores 0.94 and 0.985, mean 0.9625, std 0.0318 -> -0.7069 and +0.7069 (the group
    statistics without the penalty gave -600 / -150 with beta 0.001)."""
    triplets = attempt("a", [1.0], resp_len=3) + attempt("b", [1.0], resp_len=3)
    cfg = TrainerConfig.from_dict(
        {
            **config(adv_estimator="grpo"),
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.1}},
        }
    )
    batch, _ = build_batch(triplets, max_prompt_length=64, max_response_length=64)
    kl = torch.tensor([[0.2, 0.1, 0.3], [0.05, 0.05, 0.05]])  # (B, R) per-token KL
    adv = batch_advantages(batch, cfg, kl)
    scores = [1.0 - 0.1 * 0.6, 1.0 - 0.1 * 0.15]
    mean, s = sum(scores) / 2, std(scores)
    tol = 8 * torch.finfo(torch.float32).eps / 0.045  # fp32 scores ~1 that differ by 0.045
    assert adv[0].tolist() == pytest.approx([(scores[0] - mean) / (s + 1e-6)] * 3, abs=tol)
    assert adv[1].tolist() == pytest.approx([(scores[1] - mean) / (s + 1e-6)] * 3, abs=tol)
    assert float(adv[1, 0]) == pytest.approx(0.7069, abs=1e-3)


def test_gae_keeps_the_reward_of_an_attempt_whose_last_call_failed() -> None:
    """An attempt makes one call, its second hits the context limit (no ids, no triplet), and it is
    rewarded 1.0. The reward belongs to the failed call; it must land on the last token the attempt
    kept, as for a call that truncation cut away: returns (values 0, gamma = lam = 1) [1, 1]; the
    other attempt, rewarded 0, [0, 0]. Before, the first attempt's returns were [0, 0]."""
    from trainer.batch.advantages import attempt_gae

    a = spans_attempt("a", [("call", [1, 2], [10, 11]), ("fail",), ("reward", 1.0)])
    b = spans_attempt("b", [("call", [1, 2], [10, 11]), ("reward", 0.0)])
    assert a[0].metadata["call_reward"] == 1.0
    cfg = TrainerConfig.from_dict(
        {
            "algorithm": {"adv_estimator": "gae", "gae_std_floor": 0.0},
            "actor_rollout_ref": {"rollout": {"n": 2}},
        }
    )
    batch, _ = build_batch(a + b, max_prompt_length=64, max_response_length=64)
    _adv, returns = attempt_gae(batch, torch.zeros(batch.response_mask.shape), cfg)
    assert returns.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_per_call_reward_of_a_failed_call_moves_to_the_last_kept_call() -> None:
    """discount 0 keeps rewards strictly per call: +0.3 after call 1, then call 2 fails and the final
    +1.0 follows it. The final reward moves to call 1 (the last kept): return 1.3, call_reward 1.3."""
    (only,) = spans_attempt(
        "a",
        [("call", [1], [10]), ("reward", 0.3), ("fail",), ("reward", 1.0)],
        strategy="per_call",
        discount=0.0,
    )
    assert only.reward == pytest.approx(1.3) and only.metadata["call_reward"] == pytest.approx(1.3)
    assert only.metadata["attempt_reward"] == pytest.approx(1.3)
