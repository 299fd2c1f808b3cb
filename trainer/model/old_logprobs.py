"""Where an update's old log-probs come from (the first step of trainer/model/actor.py's update), and the
train/engine gap reported either way.

- On-policy (one epoch of one mini-batch, nothing needing them before the loss): none here; the loss's
  own forward gives them, detached (``actor.on_policy_old_logprobs``), as verl does on-policy.
- Else recomputed with the current weights, or the engine's own (``actor.use_engine_logprobs``), checked
  on a probe micro-batch and recomputed for the whole batch when the gap exceeds
  ``actor.engine_logprob_gap_limit``.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from trainer.algorithms import masked_mean
from trainer.batch import Batch
from trainer.config import TrainerConfig

log = structlog.get_logger("agentloop.trainer.actor")


def from_the_loss(config: TrainerConfig, batch: Batch, has_ref: bool) -> bool:
    """Whether an update takes its old log-probs from the loss's own forward: one epoch of one mini-batch,
    so the policy has not stepped when the loss runs (``actor.on_policy_old_logprobs``), and nothing needs
    them before the loss (rollout correction, the KL in the reward with a reference model: ``has_ref``)."""
    actor = config.actor_rollout_ref.actor
    if not actor.on_policy_old_logprobs or actor.use_engine_logprobs or actor.ppo_epochs != 1:
        return False
    if config.rollout_is_level() is not None or config.algorithm.rollout_correction.rollout_rs is not None:
        return False
    if has_ref and config.algorithm.use_kl_in_reward:
        return False
    return len(set(batch.rows_on_host().group_ids)) <= actor.ppo_mini_batch_size  # one mini-batch


def old_logprobs(
    config: TrainerConfig, batch: Batch, compute: Callable[[Batch], torch.Tensor], metrics: dict[str, float]
) -> torch.Tensor:
    """Old log-probs (B, R) of ``batch``: ``compute``'s (the policy's), or the engine's with
    ``use_engine_logprobs`` when a probe of the batch's first rows (one micro-batch's worth) finds their
    mean gap to the policy's within ``engine_logprob_gap_limit``. The gap goes into ``metrics``."""
    actor = config.actor_rollout_ref.actor
    engine = batch.engine_logprobs
    if engine is None:
        return compute(batch)
    if not actor.use_engine_logprobs:
        old = compute(batch)
        gap_metrics(old, engine, batch.response_mask, metrics)
        return old
    rows = max(1, min(len(batch), actor.ppo_max_token_len_per_gpu // max(batch.input_ids.shape[1], 1)))
    probe = batch.select(torch.arange(rows))
    gap = gap_metrics(compute(probe), probe.engine_logprobs, probe.response_mask, metrics)
    recompute = gap > actor.engine_logprob_gap_limit
    metrics["actor/old_logprobs_recomputed"] = float(recompute)
    if recompute:
        log.warning("actor.engine_logprob_gap_too_large", gap_mean=gap, limit=actor.engine_logprob_gap_limit)
        return compute(batch)
    return engine


def gap_metrics(
    old: torch.Tensor, engine: torch.Tensor | None, mask: torch.Tensor, metrics: dict[str, float]
) -> float:
    """Record the train/engine log-prob gap (mean and max over the response tokens); returns the mean."""
    assert engine is not None
    gap = (old - engine[:, : old.shape[1]]).abs() * mask  # (b, R)
    mean = float(masked_mean(gap, mask.bool()))
    metrics["actor/engine_logprob_gap_mean"] = mean
    metrics["actor/engine_logprob_gap_max"] = float(gap.max())
    return mean
