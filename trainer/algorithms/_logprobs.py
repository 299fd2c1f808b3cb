"""Per-token log-probabilities, entropy and KL estimators, (B, T, V) logits -> (B, T).

Conventions: see ``trainer.algorithms``.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from agentloop.errors import ConfigError
from trainer.algorithms._masked import _check_mask, masked_mean

# defined here once; the config (trainer/config/_*.py) types its fields with this Literal (through trainer.algorithms)
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)


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
