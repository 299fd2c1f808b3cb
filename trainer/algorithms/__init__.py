"""The trainer's math: advantage estimators, policy losses, KL estimators, loss aggregation.

Conventions (as in verl's ``core_algos``): B samples, T response tokens, V vocabulary.
``response_mask`` (B, T) is 1 on tokens the model produced and is trained on, 0 on padding and on
tool/observation tokens. Every function first zeroes its inputs at masked positions, so whatever
sits there (padding garbage, tool-token logprobs) never changes a result or a gradient.
Nothing here calls ``.item()``: the results stay on the device (no CPU-GPU sync).

This module is the public face: importing it registers every built-in estimator and loss, and it
re-exports the names of its private modules:

    _registry.py        the two registries, their decorators and look-ups, the output tuples
    _masked.py          masked mean / whiten, loss aggregation (agg_loss, attempt_row_weights)
    _logprobs.py        log-probs and entropy from logits, KL estimators
    _adv_estimators.py  the registered advantage estimators (grpo, rloo, reinforce_plus_plus*, gae)
    _policy_losses.py   the registered policy losses (vanilla, gspo, pg)
    _value_loss.py      the critic's clipped value loss and explained variance
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.algorithms._adv_estimators import (
    GROUP_ESTIMATORS,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    scores_to_token_rewards,
)
from trainer.algorithms._logprobs import (
    KL_KINDS,
    KLKind,
    apply_kl_in_reward,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
)
from trainer.algorithms._masked import (
    LOSS_AGG_MODES,
    LossAggMode,
    agg_loss,
    attempt_row_weights,
    loss_denominator,
    masked_mean,
    masked_whiten,
)
from trainer.algorithms._policy_losses import gspo, pg, vanilla
from trainer.algorithms._registry import _ADV_ESTIMATORS as _ADV_ESTIMATORS
from trainer.algorithms._registry import _POLICY_LOSSES as _POLICY_LOSSES
from trainer.algorithms._registry import (
    AdvantageFn,
    AdvantageOutput,
    PolicyLossFn,
    PolicyLossOutput,
    get_adv_estimator,
    get_policy_loss,
    known_adv_estimators,
    known_policy_losses,
    register_adv_estimator,
    register_policy_loss,
)
from trainer.algorithms._value_loss import ValueLossOutput, explained_variance, value_loss

__all__ = [
    "GROUP_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "AdvantageFn",
    "AdvantageOutput",
    "KLKind",
    "LossAggMode",
    "PolicyLossFn",
    "PolicyLossOutput",
    "ValueLossOutput",
    "agg_loss",
    "apply_kl_in_reward",
    "attempt_row_weights",
    "compute_advantage",
    "compute_policy_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "get_adv_estimator",
    "get_policy_loss",
    "grpo",
    "gspo",
    "kl_penalty",
    "known_adv_estimators",
    "known_policy_losses",
    "logprobs_from_logits",
    "loss_denominator",
    "masked_mean",
    "masked_whiten",
    "pg",
    "register_adv_estimator",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "scores_to_token_rewards",
    "value_loss",
    "vanilla",
]


def compute_advantage(
    name: str, rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: Any
) -> AdvantageOutput:
    """Run the registered estimator ``name``; kwargs: index, attempt_index, call_position, values,
    gamma, lam, norm_adv_by_std."""
    return get_adv_estimator(name)(rewards, response_mask, **kwargs)


def compute_policy_loss(
    name: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **kwargs: Any,
) -> PolicyLossOutput:
    """Run the registered policy loss ``name``; kwargs: clip_ratio_low/high/c, loss_agg_mode,
    rollout_is_weights, row_weights."""
    return get_policy_loss(name)(log_prob, old_log_prob, advantages, response_mask, **kwargs)
