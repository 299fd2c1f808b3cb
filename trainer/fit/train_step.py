"""One training step of a fit: a batch of tasks enqueued as rollouts, waited for, judged, turned into
triplets and a padded batch, one policy update in the worker, the new weights into the engine, and the
step's metrics. ``rollout_config`` is what every training and validation rollout gets."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from agentloop.adapter import group_by_attempt, triplets_for_rollouts
from agentloop.resources import Resources
from agentloop.store.base import Store
from agentloop.types import RolloutConfig, RolloutStatus, Triplet
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.fit.rollout_wait import deadline, failure_summary, wait_all
from trainer.run_folder.checkpoint import DataCursor

log = structlog.get_logger("agentloop.trainer")

Judge = Callable[[Store, list[str]], Awaitable[dict[str, float]]]  # rollout ids -> the judge's metrics
Sync = Callable[[Any, Any], Awaitable[tuple[int, dict[str, float]]]]  # (worker, engine) -> version, metrics


@dataclass
class Pending:
    """A batch enqueued for a step, not trained yet."""

    step: int
    rollout_ids: list[str]
    enqueued_at: float
    cursor_before: dict[str, int]  # the data cursor before this batch was drawn (what a resume restarts from)


def rollout_config(config: TrainerConfig) -> RolloutConfig:
    """What every training and validation rollout gets: an attempt that runs over
    ``rollout.agent_timeout_s`` is cancelled (status timeout) and retried once; a runner that goes
    silent for 300 s leaves its attempt to the unresponsive watchdog."""
    return RolloutConfig(
        max_attempts=2, unresponsive_s=300.0, timeout_s=config.actor_rollout_ref.rollout.agent_timeout_s
    )


async def enqueue_batch(
    config: TrainerConfig, store: Store, train: list[Any], cursor: DataCursor, step: int
) -> Pending:
    """The next batch of ``train`` as ``rollout.n`` training rollouts per task."""
    n = config.actor_rollout_ref.rollout.n
    ids = []
    rollout_cfg = rollout_config(config)
    cursor_before = cursor.state()
    for index, task in cursor.next_batch(train):
        for sample in range(n):
            rollout = await store.enqueue_rollout(
                task,
                "train",
                config=rollout_cfg,
                metadata={"step": step, "data_index": index, "sample_index": sample},
            )
            ids.append(rollout.rollout_id)
    return Pending(step=step, rollout_ids=ids, enqueued_at=time.perf_counter(), cursor_before=cursor_before)


async def train_step(
    store: Store,
    worker: Any,
    engine: Any,
    resources: Resources,
    pending: Pending,
    cfg: TrainerConfig,
    *,
    judge: Judge,
    sync: Sync,
) -> dict[str, float]:
    """Wait for ``pending``'s rollouts, let ``judge`` score them, build the batch, update the policy
    and ``sync`` the new weights into the engine; returns the step's metrics. An empty batch (no usable
    attempt) skips the update and the sync: ``batch/samples`` is 0 and the metrics count the attempts by
    why they were unusable (trainer/fit/learning_signal.py decides whether the fit goes on)."""
    limits = cfg.trainer.timeouts
    t_wait = time.perf_counter()
    finished = await wait_all(store, pending.rollout_ids, limits.rollouts_s, f"step {pending.step + 1}")
    rollout_s = time.perf_counter() - pending.enqueued_at
    wait_s = time.perf_counter() - t_wait
    judged = await judge(store, pending.rollout_ids)  # Reward spans, before the triplets
    adapted = await triplets_for_rollouts(store, pending.rollout_ids, cfg.adapter.credit_assignment)
    triplets = adapted.triplets
    batch, batch_stats = build_batch(
        triplets,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        pad_token_id=pad_id(engine),
        merge=cfg.adapter.trajectory,
        max_row_tokens=cfg.data.row_tokens,
        default_temperature=cfg.actor_rollout_ref.rollout.temperature,
    )
    metrics: dict[str, float] = {
        "rollout/succeeded": float(sum(r.status is RolloutStatus.SUCCEEDED for r in finished)),
        "rollout/failed": float(sum(r.status is not RolloutStatus.SUCCEEDED for r in finished)),
        "rollout/calls_without_ids": float(adapted.stats.calls_without_ids),
        "batch/samples": float(batch_stats["num_samples"]),
        "batch/attempts": float(batch_stats["num_attempts"]),
        "batch/truncated_samples": float(batch_stats["truncated_samples"]),
        **{f"batch/{k}": float(v) for k, v in batch_stats.items() if k.startswith("dropped")},
        "timing/rollout_s": rollout_s,
        "timing/wait_s": wait_s,
        **judged,
    }
    metrics.update(attempt_metrics(triplets))
    # the model's malformed tool calls (returned as text; the proxy logs them at debug)
    metrics["rollout/tool_call_parse_errors"] = float(
        sum(bool(t.metadata.get("tool_call_parse_error")) for t in triplets)
    )
    with_calls = len(group_by_attempt(triplets))  # succeeded attempts that left a triplet
    metrics["rollout/without_calls"] = max(metrics["rollout/succeeded"] - with_calls, 0.0)
    versions = [v for t in triplets if (v := t.metadata.get("weights_version")) is not None]
    if versions:  # each sample's oldest token against the weights this update starts from
        metrics["rollout/staleness_max"] = float(engine.weights_version - min(versions))
        metrics["rollout/staleness_mean"] = float(engine.weights_version - sum(versions) / len(versions))
    metrics["rollout/mixed_version_samples"] = float(
        sum(
            t.metadata.get("newest_weights_version", v) != v
            for t in triplets
            if (v := t.metadata.get("weights_version")) is not None
        )
    )
    failed = int(metrics["rollout/failed"])
    errors = await failure_summary(store, pending.rollout_ids) if failed else ""
    if failed:
        log.warning("rollouts failed", step=pending.step + 1, failed=failed, of=len(finished), errors=errors)
    if len(batch) == 0:  # no update: the fit does not count the step (trainer/fit/learning_signal.py)
        log.warning(
            "trainer.empty_batch", step=pending.step + 1, **{k: v for k, v in batch_stats.items() if v}
        )
        return metrics
    t_update = time.perf_counter()
    metrics.update(
        await deadline(
            worker.update.remote(batch),
            limits.update_s,
            f"the policy update of step {pending.step + 1}",
            "update_s",
        )
    )
    metrics["timing/update_wall_s"] = time.perf_counter() - t_update
    t_sync = time.perf_counter()
    version, sync_metrics = await deadline(
        sync(worker, engine),
        limits.weight_sync_s,
        "the new weights to reach the engine",
        "weight_sync_s",
    )
    metrics.update(sync_metrics)
    await store.add_resources(Resources(items=resources.items))
    metrics["timing/sync_s"] = time.perf_counter() - t_sync
    metrics["weights_version"] = float(version)
    tokens = int(batch.attention_mask.sum())
    metrics["perf/rollout_tokens"] = float(tokens)
    metrics["timing/step_s"] = time.perf_counter() - t_wait
    return metrics


def attempt_metrics(triplets: list[Triplet]) -> dict[str, float]:
    """Reward per attempt (each attempt once, whatever its number of calls), calls per attempt and
    response length per call."""
    attempts = group_by_attempt(triplets)
    rewards: list[float] = []
    for attempt in attempts:
        totals = [t.metadata.get("attempt_reward", t.reward) for t in (triplets[i] for i in attempt)]
        known = [x for x in totals if x is not None]
        if known:
            rewards.append(float(known[-1]))
    if not rewards:
        return {}
    rt = torch.tensor(rewards)
    return {
        "reward/mean": float(rt.mean()),
        "reward/std": float(rt.std(unbiased=False)),
        "rollout/calls_per_attempt": len(triplets) / len(attempts),
        "response/length_mean": sum(len(t.response_ids) for t in triplets) / len(triplets),
    }


def pad_id(engine: Any) -> int:
    """The engine tokenizer's padding id (its end-of-sequence id when it has none)."""
    tok = engine.tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
