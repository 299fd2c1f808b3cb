"""Rollout correction on hand-computed cases: truncated IS weights, rejection masks, KL metrics."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.errors import ConfigError
from trainer.algorithms import vanilla
from trainer.algorithms.rollout_correction import RolloutCorrectionConfig, rollout_correction
from trainer.config import TrainerConfig

# fp32 results against float64 expectations of size ~1 (advantages, IS weights <= 2), each a few
# operations and sums of <= 10 terms: a few ulps apart on any CPU; 64 eps (7.6e-6) leaves room
FP32_TOL = 64 * torch.finfo(torch.float32).eps

# row 0: log r = old - behaviour = [0.5, -1.0, 0.0]; row 1: [-2.0, -2.0] and a padding token
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -3.0, -7.0]])
BEHAVIOUR = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -1.0, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
E = math.exp


def correct(level: str | None, **cfg: object) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    out = rollout_correction(OLD, BEHAVIOUR, MASK, RolloutCorrectionConfig(**cfg), level)  # type: ignore[arg-type]
    return out.weights, out.keep, out.metrics


def test_token_level_truncated_is() -> None:
    weights, keep, metrics = correct("token", rollout_is_threshold=1.5)
    expected = [[1.5, E(-1.0), 1.0], [E(-2.0), E(-2.0), 0.0]]  # e^0.5 = 1.65 truncated to 1.5
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor(expected), atol=FP32_TOL, rtol=0)
    assert metrics["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx((1.5 + E(-1) + 1 + 2 * E(-2)) / 5)
    assert keep.tolist() == MASK.bool().tolist()  # IS alone rejects nothing


def test_sequence_level_truncated_is_and_kl_metrics() -> None:
    weights, _, metrics = correct("sequence", rollout_is_threshold=2.0)
    assert weights is not None
    expected = torch.tensor([[E(-0.5)] * 3, [E(-4.0), E(-4.0), 0.0]])
    torch.testing.assert_close(weights, expected, atol=FP32_TOL, rtol=0)
    assert metrics["rollout_corr/is_truncated_frac"] == 0.0
    log_r = [0.5, -1.0, 0.0, -2.0, -2.0]
    assert metrics["rollout_corr/kl_k1"] == pytest.approx(sum(-x for x in log_r) / 5)  # KL(b || old)
    assert metrics["rollout_corr/kl_k3"] == pytest.approx(sum(E(x) - 1 - x for x in log_r) / 5, abs=FP32_TOL)


def test_batch_normalised_weights_have_mean_one() -> None:
    weights, _, _ = correct("token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    assert weights is not None and float(weights.sum() / MASK.sum()) == pytest.approx(1.0)


def test_token_rejection_masks_tokens_out_of_bounds() -> None:
    _, keep, metrics = correct(None, rollout_rs="token", rollout_rs_threshold="0.5_1.5")
    # r = [1.65, 0.37, 1] and [0.14, 0.14]: only the ratio-1 token stays
    assert keep.tolist() == [[False, False, True], [False, False, False]]
    assert metrics["rollout_corr/rs_rejected_frac"] == pytest.approx(4 / 5)
    assert metrics["rollout_corr/rs_rejected_seq_frac"] == 1.0


@pytest.mark.parametrize(("level", "alias"), [("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")])
def test_sequence_and_geometric_rejection_drop_whole_samples(level: str, alias: str) -> None:
    # row 0: product e^-0.5 = 0.61, geometric mean e^-1/6 = 0.85 (inside [0.5, 2]); row 1: e^-4, e^-2 (out)
    for name in (level, alias):
        _, keep, metrics = correct(None, rollout_rs=name, rollout_rs_threshold=2.0)
        assert keep.tolist() == [[True, True, True], [False, False, False]]
        assert metrics["rollout_corr/rs_rejected_seq_frac"] == 0.5


def test_is_weights_scale_each_tokens_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    plain = vanilla(logp, logp.detach(), adv, mask).loss
    weighted = vanilla(logp, logp.detach(), adv, mask, rollout_is_weights=torch.tensor([[2.0, 0.5]])).loss
    assert float(plain.detach()) == pytest.approx(0.0) and float(weighted.detach()) == pytest.approx(
        (-2.0 + 0.5) / 2
    )


def test_on_by_default_only_when_sampling_can_be_off_policy() -> None:
    assert TrainerConfig().rollout_is_level() is None
    for override in (
        {"actor_rollout_ref": {"rollout": {"max_staleness": 1}}},
        {"actor_rollout_ref": {"actor": {"use_engine_logprobs": True}}},
        {"actor_rollout_ref": {"rollout": {"engine_backend": "vllm"}}},
    ):
        assert TrainerConfig.from_dict(override).rollout_is_level() == "token"
    off = {
        "algorithm": {"rollout_correction": {"rollout_is": None}},
        "actor_rollout_ref": {"rollout": {"max_staleness": 1}},
    }
    assert TrainerConfig.from_dict(off).rollout_is_level() is None


def test_bad_thresholds_are_named() -> None:
    with pytest.raises(ConfigError, match="rollout_rs='token' needs rollout_rs_threshold"):
        TrainerConfig.from_dict({"algorithm": {"rollout_correction": {"rollout_rs": "token"}}})
    with pytest.raises(ConfigError, match=r"needs 0 < lower < upper, got lower=2\.0, upper=1\.0"):
        TrainerConfig.from_dict(
            {"algorithm": {"rollout_correction": {"rollout_rs": "token", "rollout_rs_threshold": "2_1"}}}
        )
    with pytest.raises(ConfigError, match="rollout_rs"):
        TrainerConfig.from_dict({"algorithm": {"rollout_correction": {"rollout_rs": "seq_max_k2"}}})
