"""The registered advantage estimators: grpo, rloo, reinforce_plus_plus(_baseline), gae.

Conventions: see ``trainer.algorithms``.

Attempts, not calls, are the unit of the group estimators: an agent's attempt at a task may make
several LLM calls (B rows), but it votes once. ``attempt_index`` (B,) says which attempt each row
belongs to and ``call_position`` (B,) which of its calls the row is (the adapter's ``call_index``;
without it, the rows' order within the attempt). Each row's score (its call's return, the adapter's
credit assignment) is compared with the group's attempts *at the same call position*:

    S[j, k] = attempt j's score at call k; where j has no call k, its nearest earlier call's score
              (an attempt that ended stands at its last return), before its first call its first's
    GRPO     A[i, k] = (G[i, k] - mean_j S[j, k]) / (std_j S[j, k] + eps)      (std unbiased, as verl)
    RLOO     A[i, k] =  G[i, k] - mean_{j != i} S[j, k]
    RF++-b   A[i, k] =  G[i, k] - mean_j S[j, k], then whitened over the batch

With ``identical`` credit every call's score is the attempt's total, so every position holds the
attempts' totals and this is the attempt-level estimator of GRPO (Shao et al. 2024) with one vote per
attempt. With ``per_call`` credit a call's return is compared with the returns the group's attempts
got at the same point, a time-dependent baseline (REINFORCE with b_t = E[G_t], Williams 1992;
Greensmith et al. 2004), never with attempt totals: a group whose attempts earned the same rewards
at the same calls gets 0 everywhere. A group whose scores at a position are equal up to float
rounding (``EQUAL_SCORES_RTOL``) gets exactly 0 there. Without ``attempt_index`` each row is its own
attempt.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.algorithms._masked import _check_mask, attempt_row_weights, dense_ids, masked_whiten
from trainer.algorithms._registry import AdvantageOutput, register_adv_estimator

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # need several samples per group
# Scores within this fraction of their size of each other are equal: fp32 sums of a few rewards (and
# KL terms) that are equal in exact arithmetic land a few ulps (~1e-7 each) apart, never 16.
EQUAL_SCORES_RTOL = 16 * torch.finfo(torch.float32).eps


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


def _row_positions(att: torch.Tensor) -> torch.Tensor:
    """(B,) each row's order among its attempt's rows: 0, 1, ... as the rows come."""
    b = att.shape[0]
    rows = torch.arange(b, device=att.device)
    order = (att * b + rows).argsort()  # (B,) rows sorted by attempt, then as they come
    ordered = att[order]
    first = torch.full((b,), b, dtype=torch.long, device=att.device).scatter_reduce_(
        0, ordered, rows, reduce="amin"
    )  # each attempt's first place in the sorted order
    return torch.empty_like(rows).scatter_(0, order, rows - first[ordered])


def _position_table(
    scores: torch.Tensor, attempt_index: torch.Tensor | None, call_position: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each attempt's score at every call position, the rows' attempts (B,) and positions (B,).

    ``table`` (A, P): row a holds attempt a's scores by call position; a position where the attempt
    has no call takes its nearest earlier call's score (an attempt that ended, or whose call failed,
    stands at its last return), and positions before its first call take that first call's score."""
    b = scores.shape[0]
    att = torch.arange(b, device=scores.device) if attempt_index is None else dense_ids(attempt_index)
    if call_position is None:
        pos = _row_positions(att)
    else:
        if call_position.shape != scores.shape:
            raise ValueError(
                f"call_position must be (B,)={tuple(scores.shape)}, got {tuple(call_position.shape)}"
            )
        pos = dense_ids(call_position)  # positions that no attempt has are skipped
    # note: CPU-GPU sync: the table's size is read back (A attempts x P positions, both small)
    a, p = (int(att.max()) + 1, int(pos.max()) + 1) if b else (0, 0)
    cell = att * p + pos  # (B,)
    taken = torch.zeros(a * p, dtype=torch.long, device=scores.device).index_add_(
        0, cell, torch.ones_like(cell)
    )
    if bool((taken > 1).any()):  # note: CPU-GPU sync
        raise ValueError("two rows of one attempt have the same call_position: each call is one row")
    table = torch.zeros(a * p, dtype=torch.float32, device=scores.device)
    table = table.scatter_(0, cell, scores.float()).view(a, p)  # (A, P)
    present = (taken > 0).view(a, p)  # (A, P)
    columns = torch.arange(p, device=scores.device).expand(a, p)  # (A, P)
    last = torch.where(present, columns, -1).cummax(dim=1).values  # (A, P) latest call at or before
    first = torch.where(present, columns, p).min(dim=1, keepdim=True).values  # (A, 1) first call
    source = torch.where(last >= 0, last, first.expand(a, p))  # (A, P)
    return att, pos, table.gather(1, source)


def _group_stats(
    scores: torch.Tensor,
    index: torch.Tensor | None,
    attempt_index: torch.Tensor | None = None,
    call_position: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row (B,), over its group's attempts at the row's call position (``_position_table``):
    their number, the sum of their scores, their unbiased std, and whether they are all equal
    (their spread is within float rounding of their size: such a group gets exactly 0)."""
    if index is None:
        raise ValueError(
            "this estimator compares samples of one group: pass index, a (B,) tensor of group ids"
        )
    if index.shape != scores.shape:
        raise ValueError(f"index must be (B,)={tuple(scores.shape)}, got shape {tuple(index.shape)}")
    att, pos, table = _position_table(scores, attempt_index, call_position)  # (B,), (B,), (A, P)
    inv = dense_ids(index)  # (B,) group number of each row
    a, p = table.shape
    g = scores.shape[0]  # an upper bound on the number of groups
    group_of = torch.zeros(a, dtype=torch.long, device=scores.device).scatter_(0, att, inv)  # (A,)
    if bool((group_of[att] != inv).any()):  # note: CPU-GPU sync
        raise ValueError("index must give every row of one attempt the same group")
    count = torch.zeros(g, device=scores.device).index_add_(0, group_of, torch.ones(a, device=scores.device))
    total = torch.zeros(g, p, device=scores.device).index_add_(0, group_of, table)  # (G, P)
    mean = total / count.clamp(min=1)[:, None]
    sq = torch.zeros(g, p, device=scores.device).index_add_(0, group_of, (table - mean[group_of]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1)[:, None])  # (G, P)
    spot = group_of[:, None].expand(a, p)
    high = torch.full((g, p), -torch.inf, device=scores.device).scatter_reduce_(0, spot, table, "amax")
    low = torch.full((g, p), torch.inf, device=scores.device).scatter_reduce_(0, spot, table, "amin")
    size = torch.maximum(high.abs(), low.abs())
    equal = (high - low) <= EQUAL_SCORES_RTOL * size  # (G, P)
    return count[inv], total[inv, pos], std[inv, pos], equal[inv, pos]


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
    call_position: torch.Tensor | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> AdvantageOutput:
    """(score - mean of the group's attempts at the call's position) / (their std + eps), or without
    the division (Dr. GRPO). A group of one attempt, or whose attempts scored the same, gets 0."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, std, equal = _group_stats(scores, index, attempt_index, call_position)
    adv = scores - total / count.clamp(min=1)
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    return _broadcast(torch.where((count > 1) & ~equal, adv, 0.0), response_mask)


@register_adv_estimator("rloo")
def rloo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    attempt_index: torch.Tensor | None = None,
    call_position: torch.Tensor | None = None,
    **_: Any,
) -> AdvantageOutput:
    """score - mean of the group's *other* attempts at the call's position (leave-one-out); 0 for a
    group of one attempt or whose attempts scored the same."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, _std, equal = _group_stats(scores, index, attempt_index, call_position)
    adv = scores - (total - scores) / (count - 1).clamp(min=1)
    return _broadcast(torch.where((count > 1) & ~equal, adv, 0.0), response_mask)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    attempt_index: torch.Tensor | None = None,
    call_position: torch.Tensor | None = None,
    **_: Any,
) -> AdvantageOutput:
    """score - mean of the group's attempts at the call's position (0 for a group of one, or whose
    attempts scored the same), broadcast to the tokens, whitened over the batch with each attempt
    weighing the same."""
    scores = _as_scores(rewards, response_mask)  # (B,)
    count, total, _std, equal = _group_stats(scores, index, attempt_index, call_position)
    adv = torch.where((count > 1) & ~equal, scores - total / count.clamp(min=1), 0.0)
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
