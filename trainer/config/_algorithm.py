"""The ``algorithm`` section: advantage estimator, KL in the reward, rollout correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainer.algorithms import KLKind, known_adv_estimators
from trainer.algorithms.rollout_correction import RolloutCorrectionConfig
from trainer.config._keys import _Section


class KLCtrlConfig(_Section):
    type: Literal["fixed"] = Field(
        default="fixed", description="KL controller; only a fixed coefficient for now."
    )
    kl_coef: float = Field(
        default=0.001, ge=0, description="beta of the KL penalty in the reward (use_kl_in_reward)."
    )


class AlgorithmConfig(_Section):
    adv_estimator: str = Field(
        default="grpo", description="Advantage estimator: grpo, rloo, reinforce_plus_plus, ..."
    )
    norm_adv_by_std_in_grpo: bool = Field(
        default=True, description="Divide GRPO advantages by the group std."
    )
    use_kl_in_reward: bool = Field(
        default=False, description="Subtract kl_ctrl.kl_coef * KL(pi||ref) from rewards."
    )
    kl_penalty: KLKind = Field(default="kl", description="KL estimator used in the reward.")
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig, description="KL-in-reward coefficient.")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount for reinforce_plus_plus and gae.")
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda.")
    gae_std_floor: float = Field(
        default=0.1,
        ge=0,
        description="GAE advantages are divided by their std, but never by less (reward units): a batch "
        "where every attempt failed holds only the critic's noise, which whitening would train on at full "
        "strength.",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Truncated importance sampling and rejection masks against the engine's log-probs.",
    )
    overlong_filter: bool = Field(
        default=False,
        description="Mask the loss of truncated samples but keep them in group statistics (DAPO).",
    )

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        if v not in known_adv_estimators():
            raise ValueError(f"must be one of {', '.join(known_adv_estimators())}; got {v!r}")
        return v
