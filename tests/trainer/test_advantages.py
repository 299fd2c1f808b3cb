"""Advantages per attempt (trainer/advantages.py): each attempt votes once, merging changes nothing,
nothing removes part of an attempt. Every expected value is computed by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.errors import ConfigError
from agentloop.types import Triplet
from trainer import sample_advantages
from trainer.advantages import batch_advantages
from trainer.algorithms import agg_loss, attempt_row_weights
from trainer.batch import build_batch
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
    votes = [1.5, 0.0, 1.0]
    mean, s = sum(votes) / 3, std(votes)
    assert flat[:2] == pytest.approx([(1.5 - mean) / (s + 1e-6), (1.0 - mean) / (s + 1e-6)], abs=FP32_TOL)
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


def test_an_unusable_attempt_leaves_whole_and_the_group_uses_the_rest() -> None:
    long_prompt = attempt("a", [1.0, 1.0])
    long_prompt[1] = long_prompt[1].model_copy(update={"prompt_ids": [1] * 100})
    no_reward = [t.model_copy(update={"reward": None}) for t in attempt("e", [0.0])]
    triplets = long_prompt + attempt("b", [0.5]) + attempt("c", [0.0]) + no_reward
    adv = sample_advantages(triplets, config(adv_estimator="grpo"))
    votes = [0.5, 0.0]
    mean, s = sum(votes) / 2, std(votes)
    assert adv[:2] == [None, None] and adv[4] is None  # the whole attempt, not just the long call
    assert adv[2:4] == pytest.approx([(v - mean) / (s + 1e-6) for v in votes], abs=FP32_TOL)


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
    from trainer.train_step import attempt_metrics

    triplets = attempt("a", [1.0] * 5) + attempt("b", [0.0])  # per call the mean would be 5 / 6
    metrics = attempt_metrics(triplets)
    assert metrics["reward/mean"] == 0.5 and metrics["rollout/calls_per_attempt"] == 3.0
