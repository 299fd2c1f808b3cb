"""The built-in losses as the Tinker docs write them, on numbers small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.tinker.losses import LossError, check_loss, compute_loss

LP = torch.tensor([-1.0, -0.5, -2.0])
Q = torch.tensor([-1.0, -1.0, -1.0])  # the sampler's logprobs
ADV = torch.tensor([1.0, 1.0, -1.0])


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs() -> None:
    w = torch.tensor([0.0, 1.0, 2.0])
    assert compute_loss("cross_entropy", LP, {"weights": w}, {}).sum().item() == pytest.approx(0.5 + 4.0)


def test_importance_sampling_weights_advantages_by_the_ratio() -> None:
    loss = compute_loss("importance_sampling", LP, {"logprobs": Q, "advantages": ADV}, {})
    ratios = [1.0, math.exp(0.5), math.exp(-1.0)]
    assert loss.tolist() == pytest.approx([-ratios[0], -ratios[1], ratios[2]])


def test_ppo_clips_the_ratio_at_0_8_and_1_2_by_default() -> None:
    loss = compute_loss("ppo", LP, {"logprobs": Q, "advantages": ADV}, {})
    # ratio e^0.5 = 1.65 with A > 0: min(1.65, 1.2) -> 1.2; ratio e^-1 = 0.37 with A < 0: min(-0.37, -0.8) -> -0.8
    assert loss.tolist() == pytest.approx([-1.0, -1.2, 0.8])
    wide = compute_loss(
        "ppo", LP, {"logprobs": Q, "advantages": ADV}, {"clip_low_threshold": 0.1, "clip_high_threshold": 2.0}
    )
    assert wide.tolist() == pytest.approx([-1.0, -math.exp(0.5), math.exp(-1.0)])


def test_ppo_gradient_vanishes_where_clipped() -> None:
    lp = LP.clone().requires_grad_(True)
    compute_loss("ppo", lp, {"logprobs": Q, "advantages": ADV}, {}).sum().backward()
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([-1.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        ("dro", {}, "not supported"),
        ("cross_entropy", {"beta": 1.0}, "not used by cross_entropy"),
        ("ppo", {"clip_low_threshold": "x"}, "must be a number"),
    ],
)
def test_check_loss_says_what_is_wrong(loss_fn: str, config: dict, message: str) -> None:
    with pytest.raises(LossError, match=message):
        check_loss(loss_fn, config)
