"""The trainer's math: advantage estimators, policy losses, KL estimators, loss aggregation.

Conventions (as in verl's ``core_algos``): B samples, T response tokens, V vocabulary.
``response_mask`` (B, T) is 1 on tokens the model produced and is trained on, 0 on padding and on
tool/observation tokens. Every function first zeroes its inputs at masked positions, so whatever
sits there (padding garbage, tool-token logprobs) never changes a result or a gradient.
Nothing here calls ``.item()``: the results stay on the device (no CPU-GPU sync).

Attempts, not calls, are the unit of the group estimators: an agent's attempt at a task may make
several LLM calls (B rows), but it votes once. ``attempt_index`` (B,) says which attempt each row
belongs to and ``attempt_scores`` (B,) gives that attempt's return (its total reward); the group
mean / std / leave-one-out baseline are taken over attempts, and each row's own score (its call's
return) is compared with them. Without ``attempt_index`` each row is its own attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import torch

from agentloop.errors import ConfigError

# the names are defined here once; trainer/config.py types its fields with these Literals
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "attempt-mean-token-mean"]
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KL_KINDS: tuple[str, ...] = get_args(KLKind)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # need several samples per group


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


# ---------------------------------------------------------------- registries


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


# ---------------------------------------------------------------- masked statistics


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
    denominator: float | None = None,
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


def attempt_row_weights(mask: torch.Tensor, attempt_index: torch.Tensor) -> torch.Tensor:
    """(B,) weights for attempt-mean-token-mean: 1 / (number of attempts with a valid token x the valid
    tokens of the row's attempt). Computed once on a whole mini-batch, they make micro-batch losses add
    up to the mini-batch's loss."""
    m = mask.bool()
    if attempt_index.shape != m.shape[:1]:
        raise ValueError(f"attempt_index must be (B,)={tuple(m.shape[:1])}, got {tuple(attempt_index.shape)}")
    _, inv = torch.unique(attempt_index, return_inverse=True)  # (B,)  note: CPU-GPU sync
    tokens = torch.zeros(m.shape[0], device=m.device).index_add_(0, inv, m.sum(-1).float())  # per attempt
    attempts = (tokens > 0).sum().clamp(min=1)
    return torch.where(tokens[inv] > 0, 1.0 / (tokens[inv].clamp(min=1) * attempts), 0.0)


# ---------------------------------------------------------------- log-probabilities, entropy, KL


def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[ids] in float32: (B, T, V), (B, T) -> (B, T).

    Pass logits already divided by each token's sampling temperature: the engines report
    log_softmax(logits / T) of the tokens they sampled (agentloop/engine/base.py), and the trainer's
    old, new and reference log-probs are those of the same tempered policy.
    Computed as logit - logsumexp to avoid materialising the (B, T, V) log-softmax.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} disagree on (B, T)")
    logits = logits.float()
    picked = logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim: (B, T, V) -> (B, T), in float32.

    H = logsumexp(z) - sum(p * z) never takes log of a small probability, so it stays finite; z is
    shifted by its max first so large logits do not cancel in float32.
    """
    z = logits.float()
    z = z - z.max(dim=-1, keepdim=True).values  # (B, T, V), max 0
    p = torch.softmax(z, dim=-1)  # (B, T, V)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)  # (B, T)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs, (B, T) -> (B, T).

    kl / k1:         log pi - log pi_ref
    abs:             |log pi - log pi_ref|
    mse / k2:        0.5 * (log pi - log pi_ref)^2
    low_var_kl / k3: exp(r) - r - 1 with r = log pi_ref - log pi, r clamped to [-20, 20] and the result
                     to [-10, 10] (as verl does, for stability)
    """
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ")
    diff = logprob - ref_logprob  # (B, T)
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        r = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)
    raise ConfigError(f"kl estimator must be one of {', '.join(KL_KINDS)}; got {kind!r}")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards = scores - beta * kl on valid tokens (0 elsewhere); also returns the mean per-sequence KL."""
    m = _check_mask(token_level_scores, mask, "token_level_scores")
    kl = kl.masked_fill(~m, 0.0)  # (B, T)
    rewards = (token_level_scores - beta * kl).masked_fill(~m, 0.0)  # (B, T)
    return rewards, masked_mean(kl, m, dim=-1).mean()


# ---------------------------------------------------------------- advantage estimators


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sample's score on its last valid response token: (B,), (B, T) -> (B, T)."""
    m = response_mask.bool()
    if scores.dim() != 1 or scores.shape[0] != m.shape[0]:
        raise ValueError(f"scores must be (B,) with B={m.shape[0]}, got shape {tuple(scores.shape)}")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)  # (B, T)
    last = torch.where(m, positions, -1).max(-1).values  # (B,), -1 when no valid token
    out = torch.zeros(m.shape, dtype=torch.float32, device=scores.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores[rows].float()
    return out


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
    # note: torch.unique is a CPU-GPU sync point (its output size depends on the data)
    _, att = torch.unique(attempt_index, return_inverse=True)  # (B,)
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
    # note: torch.unique is a CPU-GPU sync point (its output size depends on the data)
    _, inv = torch.unique(index, return_inverse=True)  # (B,) group number of each sample
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
    attempts = torch.unique(attempt_index[m.any(-1)]).numel()  # note: CPU-GPU sync
    var = ((x - mean) ** 2 * w).sum() * attempts / max(attempts - 1, 1)  # Bessel over attempts
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
    denominator: float | None = None,
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


def compute_advantage(
    name: str, rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: Any
) -> AdvantageOutput:
    """Run the registered estimator ``name``; kwargs: index, attempt_index, attempt_scores, values,
    gamma, lam, norm_adv_by_std."""
    return get_adv_estimator(name)(rewards, response_mask, **kwargs)


# ---------------------------------------------------------------- policy losses


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
