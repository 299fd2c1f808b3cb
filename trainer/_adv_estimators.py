"""The registered advantage estimators: grpo, rloo, reinforce_plus_plus(_baseline), gae.

Conventions: see ``trainer.algorithms``.

Attempts, not calls, are the unit of the group estimators: an agent's attempt at a task may make
several LLM calls (B rows), but it votes once. ``attempt_index`` (B,) says which attempt each row
belongs to and ``attempt_scores`` (B,) gives that attempt's return (its total reward); the group
mean / std / leave-one-out baseline are taken over attempts, and each row's own score (its call's
return) is compared with them. Without ``attempt_index`` each row is its own attempt.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer._masked import _check_mask, attempt_row_weights, dense_ids, masked_whiten
from trainer._registry import AdvantageOutput, register_adv_estimator

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # need several samples per group


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sample's score on its last valid response token: (B,), (B, T) -> (B, T)."""
    m = response_mask.bool()
    if scores.dim() != 1 or scores.shape[0] != m.shape[0]:
        raise ValueError(f"scores must be (B,) with B={m.shape[0]}, got shape {tuple(scores.shape)}")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)  # (B, T)
    last = torch.where(m, positions, -1).max(-1).values  # (B,), -1 when no valid token
    out = torch.zeros(m.shape, dtype=torch.float32, device=scores.device)
    # a row without a valid token puts a 0 on its column 0, which stays 0
    value = torch.where(last >= 0, scores.float(), 0.0)[:, None]  # (B, 1)
    return out.scatter_(1, last.clamp(min=0)[:, None], value)


def _as_scores(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores, or (B, T) token rewards summed over valid tokens -> (B,)."""
    if rewards.dim() == 1:
        if rewards.shape[0] != response_mask.shape[0]:
            raise ValueError(
                f"scores have {rewards.shape[0]} entries, response_mask has {response_mask.shape[0]}"
            )
        return rewards.float()
    m = _check_mask(rewards, response_mask, "token_level_rewards")
    return rewards.float().masked_fill(~m, 0.0).sum(-1)


def _as_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if rewards.dim() == 1:
        return scores_to_token_rewards(rewards, response_mask)
    m = _check_mask(rewards, response_mask, "token_level_rewards")
    return rewards.float().masked_fill(~m, 0.0)


def _attempt_votes(
    scores: torch.Tensor, attempt_index: torch.Tensor | None, attempt_scores: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which attempt each row belongs to (B,) numbered 0..A-1, whether the row is its attempt's first
    (B,) bool, and the attempt's score for each row (B,). Without ``attempt_index`` every row is an
    attempt of its own scored by its own score."""
    b = scores.shape[0]
    if attempt_index is None:
        return (
            torch.arange(b, device=scores.device),
            torch.ones(b, dtype=torch.bool, device=scores.device),
            scores,
        )
    if attempt_index.shape != scores.shape:
        raise ValueError(
            f"attempt_index must be (B,)={tuple(scores.shape)}, got {tuple(attempt_index.shape)}"
        )
    votes = scores if attempt_scores is None else attempt_scores.float()
    if votes.shape != scores.shape:
        raise ValueError(f"attempt_scores must be (B,)={tuple(scores.shape)}, got {tuple(votes.shape)}")
    att = dense_ids(attempt_index)  # (B,)
    rows = torch.arange(b, device=scores.device)
    first_row = torch.full((b,), b, device=scores.device, dtype=torch.long).scatter_reduce_(
        0, att, rows, reduce="amin"
    )  # (A <= B,) the first row of each attempt
    return att, first_row[att] == rows, votes


def _group_stats(
    scores: torch.Tensor,
    index: torch.Tensor | None,
    attempt_index: torch.Tensor | None = None,
    attempt_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """For each row (B,): the number of attempts in its group, the sum of their scores, their unbiased
    std, and the row's own attempt's score; each attempt counted once (by its first row)."""
    if index is None:
        raise ValueError(
            "this estimator compares samples of one group: pass index, a (B,) tensor of group ids"
        )
    if index.shape != scores.shape:
        raise ValueError(f"index must be (B,)={tuple(scores.shape)}, got shape {tuple(index.shape)}")
    _att, first, votes = _attempt_votes(scores, attempt_index, attempt_scores)
    inv = dense_ids(index)  # (B,) group number of each sample
    g = scores.shape[0]  # an upper bound on the number of groups (no CPU-GPU sync)
    one = first.float()  # (B,) 1 on the row that casts its attempt's vote
    count = torch.zeros(g, device=scores.device).index_add_(0, inv, one)[inv]  # (B,)
    total = torch.zeros(g, device=scores.device).index_add_(0, inv, votes * one)[inv]  # (B,)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(g, device=scores.device).index_add_(0, inv, (votes - mean) ** 2 * one)[inv]
    std = torch.sqrt(sq / (count - 1).clamp(min=1))  # (B,)
    return count, total, std, votes


def _attempt_weighted_whiten(
    x: torch.Tensor, mask: torch.Tensor, attempt_index: torch.Tensor | None, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` (B, T) over its valid tokens with each attempt weighing the same (its tokens share
    one vote); without ``attempt_index`` every token weighs the same (verl's masked_whiten)."""
    m = _check_mask(x, mask)
    if attempt_index is None:
        return masked_whiten(x, m, eps)
    w = attempt_row_weights(m, attempt_index)[:, None] * m  # (B, T), sums to 1
    x = x.masked_fill(~m, 0.0)
    mean = (x * w).sum()
    att = dense_ids(attempt_index)  # (B,)
    valid = torch.zeros(att.shape[0], device=x.device).index_add_(0, att, m.any(-1).float())  # per attempt
    attempts = (valid > 0).sum()  # attempts with a valid token
    var = ((x - mean) ** 2 * w).sum() * attempts / (attempts - 1).clamp(min=1)  # Bessel over attempts
    return ((x - mean) * torch.rsqrt(var + eps)).masked_fill(~m, 0.0)


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> AdvantageOutput:
    out = adv.unsqueeze(-1) * response_mask.float()  # (B, T)
    return AdvantageOutput(out, out.clone())


@register_adv_estimator("grpo")
def grpo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    attempt_index: torch.Tensor | None = None,
    attempt_scores: torch.Tensor | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> AdvantageOutput:
    """(score - mean of the group's attempts) / (their std + eps), or without the division (Dr. GRPO).
    A group of one attempt has no baseline: its advantage is 0."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, std, _votes = _group_stats(scores, index, attempt_index, attempt_scores)
    adv = scores - total / count.clamp(min=1)
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    return _broadcast(torch.where(count > 1, adv, 0.0), response_mask)


@register_adv_estimator("rloo")
def rloo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    attempt_index: torch.Tensor | None = None,
    attempt_scores: torch.Tensor | None = None,
    **_: Any,
) -> AdvantageOutput:
    """score - mean of the group's *other* attempts (leave-one-out); 0 for a group of one attempt."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, _std, votes = _group_stats(scores, index, attempt_index, attempt_scores)
    adv = scores - (total - votes) / (count - 1).clamp(min=1)
    return _broadcast(torch.where(count > 1, adv, 0.0), response_mask)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    attempt_index: torch.Tensor | None = None,
    attempt_scores: torch.Tensor | None = None,
    **_: Any,
) -> AdvantageOutput:
    """score - mean of the group's attempts (0 for a group of one), broadcast to the tokens, whitened
    over the batch with each attempt weighing the same."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, _std, _votes = _group_stats(scores, index, attempt_index, attempt_scores)
    adv = torch.where(count > 1, scores - total / count.clamp(min=1), 0.0)
    tokens = adv.unsqueeze(-1).expand(response_mask.shape).float()  # (B, T)
    out = _attempt_weighted_whiten(tokens, response_mask, attempt_index)  # (B, T)
    return AdvantageOutput(out, out.clone())


def _discounted_returns(token_rewards: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over valid tokens; masked tokens are skipped (not discounted)."""
    returns = torch.zeros_like(token_rewards)  # (B, T)
    running = torch.zeros_like(token_rewards[:, 0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns.masked_fill(~m, 0.0)


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    attempt_index: torch.Tensor | None = None,
    **_: Any,
) -> AdvantageOutput:
    """Discounted token returns, whitened over the batch's valid tokens (each attempt weighing the same
    when ``attempt_index`` is given).

    Masked (tool) tokens are skipped, not discounted: one discount step per *model* token."""
    m = response_mask.bool()
    returns = _discounted_returns(_as_token_rewards(rewards, response_mask), m, gamma)  # (B, T)
    return AdvantageOutput(_attempt_weighted_whiten(returns, m, attempt_index), returns)


@register_adv_estimator("gae")
def gae(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    std_floor: float = 0.0,
    **_: Any,
) -> AdvantageOutput:
    """Generalised advantage estimation with a value head; masked tokens are skipped.

    delta_t = r_t + gamma * V_next - V_t ; A_t = delta_t + gamma * lam * A_next ; returns = A + V.
    Advantages are whitened over the batch's valid tokens (divided by at least ``std_floor``); returns
    are not."""
    if values is None:
        raise ValueError("gae needs values: the value head's (B, T) predictions")
    m = _check_mask(values, response_mask, "values")
    r = _as_token_rewards(rewards, response_mask)  # (B, T)
    v = values.float().masked_fill(~m, 0.0)  # (B, T)
    adv = torch.zeros_like(r)  # (B, T)
    next_v = torch.zeros_like(r[:, 0])  # (B,)
    last = torch.zeros_like(r[:, 0])  # (B,)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = torch.where(m[:, t], delta + gamma * lam * last, last)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        adv[:, t] = last
    returns = (adv + v).masked_fill(~m, 0.0)
    return AdvantageOutput(masked_whiten(adv, m, std_floor=std_floor), returns)
