"""Masked statistics over (B, T) tensors and loss aggregation (``agg_loss``'s modes).

Conventions: see ``trainer.algorithms``. Masked positions are zeroed first, so they never change a
result or a gradient.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from agentloop.errors import ConfigError

# defined here once; the config (trainer/config/_*.py) types its fields with this Literal (through trainer.algorithms)
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "attempt-mean-token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def _check_mask(x: torch.Tensor, mask: torch.Tensor, name: str = "values") -> torch.Tensor:
    """The mask as bool; raises when its shape does not match ``x``."""
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, response_mask has {tuple(mask.shape)}")
    return mask.bool()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is 1; 0 when there are none."""
    m = _check_mask(x, mask)
    x = x.masked_fill(~m, 0.0)
    if dim is None:
        return x.sum() / m.sum().clamp(min=1)
    return x.sum(dim) / m.sum(dim).clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, std_floor: float = 0.0
) -> torch.Tensor:
    """(x - mean) / std over the masked positions of the whole batch (unbiased std, like verl);
    0 at masked positions. With fewer than two valid values the std is taken as 0. ``std_floor``: never
    divide by less (a batch whose values barely vary is centred, not blown up to unit scale)."""
    m = _check_mask(x, mask)
    x = x.masked_fill(~m, 0.0)
    n = m.sum()
    mean = x.sum() / n.clamp(min=1)
    sq = ((x - mean) ** 2).masked_fill(~m, 0.0).sum()
    var = (sq / (n - 1).clamp(min=1)).clamp(min=std_floor**2)
    return ((x - mean) * torch.rsqrt(var + eps)).masked_fill(~m, 0.0)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) loss to a scalar.

    token-mean:              sum over all valid tokens / number of valid tokens
    seq-mean-token-sum:      mean over sequences of (sum over the sequence's valid tokens)
    seq-mean-token-mean:     mean over sequences of (mean over the sequence's valid tokens)
    attempt-mean-token-mean: mean over attempts of (mean over the attempt's valid tokens, in all its
                             rows): each attempt weighs the same, however many calls and tokens it has
                             (Agent Lightning's per-rollout mean). ``row_weights`` (B,): 1 / (attempts
                             x the row's attempt's valid tokens), from :func:`attempt_row_weights`;
                             without them each row is an attempt (= seq-mean-token-mean).
    Sequences with no valid token do not count. ``denominator`` replaces the count (tokens for
    token-mean, sequences otherwise): pass the whole mini-batch's count when accumulating micro-batches.
    """
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (B, T), got shape {tuple(loss_mat.shape)}")
    m = _check_mask(loss_mat, mask, "loss_mat")
    loss_mat = loss_mat.masked_fill(~m, 0.0)  # (B, T)
    if mode == "token-mean":
        count = m.sum().clamp(min=1) if denominator is None else denominator
        return loss_mat.sum() / count
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; got {mode!r}")
    if mode == "attempt-mean-token-mean":
        if row_weights is None:  # no attempt structure: each row is an attempt of its own
            row_weights = attempt_row_weights(m, torch.arange(m.shape[0], device=m.device))
        if row_weights.shape != loss_mat.shape[:1]:
            raise ValueError(
                f"row_weights must be (B,)={tuple(loss_mat.shape[:1])}, got {tuple(row_weights.shape)}"
            )
        return (loss_mat.sum(-1) * row_weights).sum()
    tokens = m.sum(-1)  # (B,)
    seq = loss_mat.sum(-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp(min=1)
    count = (tokens > 0).sum().clamp(min=1) if denominator is None else denominator
    return seq.sum() / count


def dense_ids(ids: torch.Tensor) -> torch.Tensor:
    """(B,) ids renumbered 0, 1, ... in ascending order of their values: ``torch.unique(ids,
    return_inverse=True)[1]`` without reading the ids back (unique's output size depends on them, a
    CPU-GPU sync); a sort and a running count of value changes instead."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be (B,), got shape {tuple(ids.shape)}")
    order = ids.argsort(stable=True)  # (B,)
    ordered = ids[order]
    starts = torch.ones_like(ordered, dtype=torch.long)  # (B,) 1 where a new value starts
    starts[1:] = (ordered[1:] != ordered[:-1]).long()
    return torch.empty_like(starts).scatter_(0, order, starts.cumsum(0) - 1)


def attempt_row_weights(mask: torch.Tensor, attempt_index: torch.Tensor) -> torch.Tensor:
    """(B,) weights for attempt-mean-token-mean: 1 / (number of attempts with a valid token x the valid
    tokens of the row's attempt). Computed once on a whole mini-batch, they make micro-batch losses add
    up to the mini-batch's loss."""
    m = mask.bool()
    if attempt_index.shape != m.shape[:1]:
        raise ValueError(f"attempt_index must be (B,)={tuple(m.shape[:1])}, got {tuple(attempt_index.shape)}")
    inv = dense_ids(attempt_index)  # (B,)
    tokens = torch.zeros(m.shape[0], device=m.device).index_add_(0, inv, m.sum(-1).float())  # per attempt
    attempts = (tokens > 0).sum().clamp(min=1)
    return torch.where(tokens[inv] > 0, 1.0 / (tokens[inv].clamp(min=1) * attempts), 0.0)


def loss_denominator(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What agg_loss divides a micro-batch's loss by (tokens or sequences with a token, at least 1), a
    float32 scalar on ``mask``'s device (no CPU-GPU sync); 1 for attempt-mean-token-mean, whose row
    weights already hold the whole mini-batch's denominator."""
    if agg == "attempt-mean-token-mean":
        return torch.ones((), device=mask.device)
    counted = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()
    return counted.clamp(min=1).to(torch.float32)
