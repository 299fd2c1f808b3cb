"""The registered policy losses: vanilla (PPO clip, dual clip), gspo, pg.

Conventions: see ``trainer.algorithms``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.algorithms._masked import _check_mask, agg_loss, masked_mean
from trainer.algorithms._registry import PolicyLossOutput, register_policy_loss


def _prepare(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    m = _check_mask(log_prob, response_mask, "log_prob")
    for name, x in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if x.shape != log_prob.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, log_prob has {tuple(log_prob.shape)}")
    zero = lambda x: x.masked_fill(~m, 0.0)  # noqa: E731
    return zero(log_prob), zero(old_log_prob.detach()), zero(advantages.detach()), m


def _weighted(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return losses
    if weights.shape != losses.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(weights.shape)}, the loss {tuple(losses.shape)}"
        )
    return losses * weights.detach()


@register_policy_loss("vanilla")
def vanilla(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    **_: Any,
) -> PolicyLossOutput:
    """PPO clip: max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 also capped at -A c (dual clip).
    ``rollout_is_weights`` (B, T) multiply each token's loss (rollout correction, as verl)."""
    log_prob, old_log_prob, advantages, m = _prepare(log_prob, old_log_prob, advantages, response_mask)
    neg_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # (B, T) log r
    ratio = torch.exp(neg_kl)  # (B, T)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)  # (B, T)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    losses = torch.where(advantages < 0, dual, clipped)  # (B, T)
    losses = _weighted(losses, rollout_is_weights)
    return PolicyLossOutput(
        loss=agg_loss(losses, m, loss_agg_mode, row_weights=row_weights),
        clip_frac=masked_mean((loss2 > loss1).float(), m).detach(),
        approx_kl=masked_mean(-neg_kl, m).detach(),
        clip_frac_lower=masked_mean(((clipped > loss3) & (advantages < 0)).float(), m).detach(),
    )


@register_policy_loss("gspo")
def gspo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    rollout_is_weights: torch.Tensor | None = None,
    **_: Any,
) -> PolicyLossOutput:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios,
    s = exp(mean_t(log pi - log pi_old)); the gradient flows per token through
    s_t = sg(s) * pi_t / sg(pi_t). Always aggregated seq-mean-token-mean (as in the paper and verl);
    use clip ratios of order 1e-4."""
    log_prob, old_log_prob, advantages, m = _prepare(log_prob, old_log_prob, advantages, response_mask)
    neg_kl = log_prob - old_log_prob  # (B, T)
    seq_neg_kl = masked_mean(neg_kl, m, dim=-1)  # (B,)
    log_ratio = log_prob - log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)  # (B, T)
    ratio = torch.exp(log_ratio.clamp(max=10.0))  # (B, T), value = the sequence ratio
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = _weighted(torch.maximum(loss1, loss2), rollout_is_weights)
    zero = torch.zeros((), device=log_prob.device)
    return PolicyLossOutput(
        loss=agg_loss(losses, m, "seq-mean-token-mean"),
        clip_frac=masked_mean((loss2 > loss1).float(), m).detach(),
        approx_kl=masked_mean(-neg_kl, m).detach(),
        clip_frac_lower=zero,
    )


@register_policy_loss("pg")
def pg(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    **_: Any,
) -> PolicyLossOutput:
    """Plain policy gradient (REINFORCE): -A * log pi; no ratio, no clipping."""
    log_prob, old_log_prob, advantages, m = _prepare(log_prob, old_log_prob, advantages, response_mask)
    zero = torch.zeros((), device=log_prob.device)
    losses = _weighted(-advantages * log_prob, rollout_is_weights)
    return PolicyLossOutput(
        loss=agg_loss(losses, m, loss_agg_mode, row_weights=row_weights),
        clip_frac=zero,
        approx_kl=masked_mean(old_log_prob - log_prob, m).detach(),
        clip_frac_lower=zero,
    )
