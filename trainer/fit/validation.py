"""Validation during a fit: every validation task run with the validation sampling and scored."""

from __future__ import annotations

import time
from typing import Any

import structlog

from agentloop.resources import Resources
from agentloop.store.base import Store
from agentloop.types import Reward, RolloutStatus
from trainer.config import TrainerConfig
from trainer.fit.rollout_wait import failure_summary, wait_all
from trainer.fit.train_step import Judge, rollout_config
from trainer.run_folder.metrics import MetricsLogger

log = structlog.get_logger("agentloop.trainer")


async def validate(
    store: Store,
    val: list[Any],
    metrics_log: MetricsLogger,
    resources: Resources,
    val_resources: Resources,
    step: int,
    *,
    config: TrainerConfig,
    judge: Judge,
) -> dict[str, float]:
    """Every validation task ``val_kwargs.n`` times with the validation sampling (greedy by default):
    its resources are published for the run and the training ones restored afterwards. Only
    validation rollouts run meanwhile (the loop lets in-flight training rollouts finish first)."""
    t0 = time.perf_counter()
    n = config.actor_rollout_ref.rollout.val_kwargs.n
    await store.add_resources(Resources(items=val_resources.items))
    try:
        ids = [
            (
                await store.enqueue_rollout(
                    task,
                    "val",
                    config=rollout_config(config),
                    metadata={"step": step, "sample_index": i},
                )
            ).rollout_id
            for task in val
            for i in range(n)
        ]
        finished = await wait_all(
            store, ids, config.trainer.timeouts.rollouts_s, f"validation at step {step}"
        )
    finally:
        await store.add_resources(Resources(items=resources.items))
    judged = await judge(store, ids)
    rewards = []
    for rollout in finished:
        if rollout.status is RolloutStatus.SUCCEEDED:
            spans = await store.query_spans(rollout.rollout_id, "latest")
            rewards.append(sum(s.payload.value for s in spans if isinstance(s.payload, Reward)))
        else:
            rewards.append(0.0)
    failed = sum(r.status is not RolloutStatus.SUCCEEDED for r in finished)
    if failed:
        log.warning(
            "validation rollouts failed",
            step=step,
            failed=failed,
            of=len(finished),
            errors=await failure_summary(store, ids),
        )
    mean = sum(rewards) / max(len(rewards), 1)
    metrics = {
        "val/reward_mean": mean,
        "val/success_rate": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        "val/failed": float(failed),
        "timing/val_s": time.perf_counter() - t0,
        "val/step": float(step),
        **{f"val/{k}": v for k, v in judged.items() if k.startswith("judge/")},
    }
    log.info("validation", step=step, **{k: round(v, 4) for k, v in metrics.items()})
    if step == 0:
        metrics_log.log(0, metrics)
    return metrics
