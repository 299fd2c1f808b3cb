"""The critic's math: PPO's clipped value loss and the explained variance of its predictions.

Conventions: see ``trainer.algorithms``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.algorithms._masked import _check_mask, agg_loss, masked_mean


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar
    clip_frac: torch.Tensor  # scalar: the share of valid tokens where the clipped loss was larger


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> ValueLossOutput:
    """PPO's clipped value loss (as verl's ``compute_value_loss``), all (B, T):

    V_clip = old + clamp(V - old, -c, c) ; loss = 0.5 * agg(max((V - G)^2, (V_clip - G)^2)).

    The max keeps the pessimistic of the two: a prediction that moved more than ``c`` from the value
    the advantages were computed with gets no gradient from moving further."""
    m = _check_mask(vpreds, mask, "vpreds")
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    plain_sq, clipped_sq = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(plain_sq, clipped_sq),
        m,
        loss_agg_mode,
        denominator=denominator,
        row_weights=row_weights,
    )
    return ValueLossOutput(loss, masked_mean((clipped_sq > plain_sq).float(), m))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(G - V) / Var(G) over the valid tokens: 1 is a perfect critic, 0 one no better than the
    mean return, below 0 worse than it; nan when the returns do not vary."""
    m = _check_mask(values, mask, "values")
    g, v = returns[m].double(), values[m].double()
    if g.numel() < 2:
        return float("nan")
    var_g = g.var(unbiased=False)
    # returns that do not vary (every attempt scored the same) leave nothing to explain; rounding noise in
    # their variance would otherwise give a ratio like -1e14
    if var_g <= 1e-12 * max(1.0, float(g.abs().max()) ** 2):
        return float("nan")
    return float(1.0 - (g - v).var(unbiased=False) / var_g)
