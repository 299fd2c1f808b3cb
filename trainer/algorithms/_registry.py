"""The registries: advantage estimators and policy losses by name, and the outputs they return.

``trainer.algorithms`` imports every built-in estimator and loss, so importing it fills both
registries; a user's own function joins them through ``register_adv_estimator`` /
``register_policy_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from agentloop.errors import ConfigError


class AdvantageOutput(NamedTuple):
    advantages: torch.Tensor  # (B, T), 0 at masked positions
    returns: torch.Tensor  # (B, T), 0 at masked positions (the value target for gae)


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clip_frac: torch.Tensor  # scalar, detached: share of tokens where the clipped term won
    approx_kl: torch.Tensor  # scalar, detached: masked mean of old_logprob - logprob
    clip_frac_lower: torch.Tensor  # scalar, detached: share of tokens where the dual clip won


AdvantageFn = Callable[..., AdvantageOutput]
PolicyLossFn = Callable[..., PolicyLossOutput]

_ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def _register(registry: dict[str, Any], what: str, name: str, fn: Any) -> None:
    existing = registry.get(name)
    if existing is not None and existing is not fn:
        raise ConfigError(
            f"{what} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
            "pick another name"
        )
    registry[name] = fn


def _lookup(registry: dict[str, Any], what: str, name: str) -> Any:
    if name not in registry:
        raise ConfigError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make an advantage estimator available as ``algorithm.adv_estimator=name``."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        _register(_ADV_ESTIMATORS, "advantage estimator", name, fn)
        return fn

    return deco


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a policy loss available as ``actor_rollout_ref.actor.policy_loss=name``."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        _register(_POLICY_LOSSES, "policy loss", name, fn)
        return fn

    return deco


def get_adv_estimator(name: str) -> AdvantageFn:
    return _lookup(_ADV_ESTIMATORS, "advantage estimator", name)  # type: ignore[no-any-return]


def get_policy_loss(name: str) -> PolicyLossFn:
    return _lookup(_POLICY_LOSSES, "policy loss", name)  # type: ignore[no-any-return]


def known_adv_estimators() -> list[str]:
    return sorted(_ADV_ESTIMATORS)


def known_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)
