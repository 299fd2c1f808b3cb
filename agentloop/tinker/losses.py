"""The Tinker API's built-in losses, per datum, on the target tokens' log-probabilities.

Every loss is a **sum** over the datum's tokens (Tinker's convention: the client scales ``weights`` or
``advantages`` when it wants a mean). ``target_logprobs`` is ``log p_theta(target_tokens[t] | ...)``,
shape (N,), with the graph to the model's weights; the other inputs come from ``Datum.loss_fn_inputs``.

    cross_entropy        inputs target_tokens, weights
                         loss = sum(-target_logprobs * weights)
    importance_sampling  inputs target_tokens, logprobs (the sampler's, q), advantages
                         ratio = exp(target_logprobs - logprobs);  loss = -sum(ratio * advantages)
    ppo                  inputs as importance_sampling; config clip_low_threshold (0.8), clip_high_threshold (1.2)
                         clipped = clamp(ratio, low, high)
                         loss = -sum(min(ratio * advantages, clipped * advantages))

``forward_backward_custom`` needs nothing here: the SDK runs the custom loss on the client and sends
its gradient back as a cross_entropy with ``weights = -dLoss/dlogprobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["LOSS_INPUTS", "LossError", "check_loss", "compute_loss"]

# the inputs each loss reads besides target_tokens (which every loss takes: it picks target_logprobs)
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}
PPO_CLIP = (0.8, 1.2)  # Tinker's fixed epsilon of 0.2 on both sides


class LossError(ValueError):
    """A loss asked with inputs or a config it cannot use (the request's fault: HTTP 400)."""


def _cross_entropy(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    return -lp * x["weights"]  # (N,)


def _importance_sampling(
    lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N,)
    return -ratio * x["advantages"]


def _ppo(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    low = float(cfg.get("clip_low_threshold", PPO_CLIP[0]))
    high = float(cfg.get("clip_high_threshold", PPO_CLIP[1]))
    if not 0 <= low <= high:
        raise LossError(f"ppo needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}")
    ratio = torch.exp(lp - x["logprobs"])  # (N,)
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


_LOSSES: dict[
    str, Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]
] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
}
_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
}


def check_loss(loss_fn: str, config: Mapping[str, float | str]) -> dict[str, float]:
    """The loss's numeric config; LossError for an unknown loss or config key."""
    if loss_fn not in _LOSSES:
        raise LossError(
            f"loss_fn {loss_fn!r} is not supported by this server; use one of {', '.join(_LOSSES)} "
            "(or forward_backward_custom, which runs on the client)"
        )
    unknown = set(config) - _CONFIG_KEYS[loss_fn]
    if unknown:
        allowed = ", ".join(sorted(_CONFIG_KEYS[loss_fn])) or "none"
        raise LossError(
            f"loss_fn_config keys {sorted(unknown)} are not used by {loss_fn} (it takes: {allowed})"
        )
    out: dict[str, float] = {}
    for key, value in config.items():
        if not isinstance(value, int | float):
            raise LossError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    return out


def compute_loss(
    loss_fn: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> torch.Tensor:
    """The per-token loss (N,) of one datum (module docstring); its sum is the datum's loss."""
    return _LOSSES[loss_fn](target_logprobs, inputs, config)
