"""Rollout correction: when the policy that sampled differs from the one the PPO ratio starts at.

The engine samples with weights that may lag the trainer's (``max_staleness > 0``), or with other
numerics (vLLM in bf16 against fp32 master weights); then the tokens come from a behaviour policy
``b`` while the PPO ratio starts at ``old``. As verl's ``algorithm.rollout_correction`` (same keys),
two independent tools, both driven by ``log r = log old - log b`` on each sampled token:

- **truncated importance sampling** (``rollout_is``): each token's loss is multiplied by
  ``min(r, rollout_is_threshold)``: per token (``token``), or one weight per sample, the product of
  its token ratios (``sequence``);
- **rejection** (``rollout_rs``): tokens whose ratio lies outside ``[lower, upper]`` (``token``), or
  whole samples whose ratio product (``sequence``) or geometric mean ratio (``geometric``) does, are
  masked out of the loss. They stay in the advantage statistics: the mask applies to the loss only.

Ratios are taken in log space and clamped to [-20, 20] before ``exp`` (as verl), so one very unlikely
token cannot overflow a weight. KL(b || old) is reported with the k1 (``E_b[log b - log old]``) and
k3 (``E_b[r - 1 - log r]``) estimators.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_LOG_CLAMP = 20.0
# verl's canonical rejection names for the three ratio modes
_RS_ALIASES = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}

RejectionLevel = Literal["token", "sequence", "geometric"]


class RolloutCorrectionConfig(BaseModel):
    """``algorithm.rollout_correction``: verl's keys for truncated IS and rejection masks."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rollout_is: Literal["auto", "token", "sequence"] | None = Field(
        default="auto",
        description="IS weights per token or sequence; auto: token when sampling can be off-policy; null: off.",
    )
    rollout_is_threshold: float = Field(default=2.0, gt=0, description="Upper bound of an IS weight.")
    rollout_rs: RejectionLevel | None = Field(
        default=None, description="Reject tokens (token) or samples (sequence, geometric) out of bounds."
    )
    rollout_rs_threshold: float | str | None = Field(
        default=None, description="Ratio bounds: 'lower_upper', or an upper bound (lower = 1/upper)."
    )
    rollout_is_batch_normalize: bool = Field(
        default=False, description="Scale the truncated IS weights to mean 1 over the batch."
    )

    @field_validator("rollout_rs", mode="before")
    @classmethod
    def _alias(cls, v: object) -> object:
        return _RS_ALIASES.get(v, v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None:
            self.rs_bounds()  # raises on a bad threshold
        return self

    def rs_bounds(self) -> tuple[float, float]:
        """The rejection's (lower, upper) ratio bounds."""
        spec = self.rollout_rs_threshold
        if spec is None:
            raise ValueError(
                f"rollout_rs={self.rollout_rs!r} needs rollout_rs_threshold: an upper ratio bound such "
                "as 2.0, or 'lower_upper' such as '0.5_2.0'"
            )
        if isinstance(spec, str) and "_" in spec:
            low_text, _, high_text = spec.partition("_")
            try:
                low, high = float(low_text), float(high_text)
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} must look like '0.5_2.0'") from None
        else:
            try:
                high = float(spec)
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} must be a number or 'lower_upper'") from None
            low = 1.0 / high if high > 0 else 0.0
        if not 0 < low < high:
            raise ValueError(f"rollout_rs_threshold needs 0 < lower < upper, got lower={low}, upper={high}")
        return low, high


class Correction(NamedTuple):
    weights: torch.Tensor | None  # (B, T) truncated IS weights, 0 where masked; None when IS is off
    keep: torch.Tensor  # (B, T) bool: the response mask without the rejected tokens
    metrics: dict[str, float]


def _mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~m, 0.0).sum() / m.sum().clamp(min=1)


def rollout_correction(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    is_level: str | None,
) -> Correction:
    """IS weights and the rejection mask for a batch; ``is_level`` is the resolved ``rollout_is``.

    ``old_logprobs`` and ``behaviour_logprobs`` (the engine's) are (B, T) log-probs of the sampled
    tokens; ``response_mask`` (B, T) marks the trained tokens.
    """
    if old_logprobs.shape != behaviour_logprobs.shape or old_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"old {tuple(old_logprobs.shape)}, behaviour {tuple(behaviour_logprobs.shape)} and mask "
            f"{tuple(response_mask.shape)} log-probs must have one shape"
        )
    m = response_mask.bool()  # (B, T)
    log_r = (old_logprobs.float() - behaviour_logprobs.float()).masked_fill(~m, 0.0)  # (B, T)
    seq_log_r = log_r.sum(-1)  # (B,) log of the product of the sample's ratios
    tokens = m.sum(-1)  # (B,)
    rows = tokens > 0  # (B,)
    metrics = {
        "rollout_corr/kl_k1": float(_mean(-log_r, m)),
        "rollout_corr/kl_k3": float(_mean(torch.exp(log_r.clamp(-_LOG_CLAMP, _LOG_CLAMP)) - 1 - log_r, m)),
    }
    weights = None
    if is_level is not None:
        thr = config.rollout_is_threshold
        if is_level == "token":
            raw = torch.exp(log_r.clamp(-_LOG_CLAMP, _LOG_CLAMP))  # (B, T)
            metrics["rollout_corr/is_truncated_frac"] = float(_mean((raw > thr).float(), m))
            weights = raw.clamp(max=thr)
        elif is_level == "sequence":
            raw_seq = torch.exp(seq_log_r.clamp(-_LOG_CLAMP, _LOG_CLAMP))  # (B,)
            metrics["rollout_corr/is_truncated_frac"] = float(
                (raw_seq > thr)[rows].float().mean() if bool(rows.any()) else 0.0
            )
            weights = raw_seq.clamp(max=thr)[:, None].expand_as(log_r).clone()
        else:
            raise ValueError(f"rollout_is must be token, sequence or None, got {is_level!r}")
        weights = weights.masked_fill(~m, 0.0)
        if config.rollout_is_batch_normalize:
            mean = _mean(weights, m) if is_level == "token" else weights[:, 0][rows].mean()
            weights = weights / mean.clamp(min=1e-8)
        metrics["rollout_corr/is_weight_mean"] = float(_mean(weights, m))
    keep = m
    if config.rollout_rs is not None:
        low, high = config.rs_bounds()
        lo, hi = torch.log(torch.tensor(low)), torch.log(torch.tensor(high))
        if config.rollout_rs == "token":
            reject = (log_r < lo) | (log_r > hi)  # (B, T)
        else:
            stat = seq_log_r if config.rollout_rs == "sequence" else seq_log_r / tokens.clamp(min=1)  # (B,)
            reject = ((stat < lo) | (stat > hi))[:, None].expand_as(m)
        keep = m & ~reject
        metrics["rollout_corr/rs_rejected_frac"] = float(_mean(reject.float(), m))
        metrics["rollout_corr/rs_rejected_seq_frac"] = float(
            (reject & m).any(-1)[rows].float().mean() if bool(rows.any()) else 0.0
        )
    return Correction(weights=weights, keep=keep, metrics=metrics)


__all__ = ["Correction", "RolloutCorrectionConfig", "rollout_correction"]
