"""A run's checkpoints through the trainer worker: one per ``trainer.save_freq`` steps, the resume from
the plan's checkpoint, and the final model (trainer/run_folder/checkpoint.py keeps the folders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from agentloop.store.base import Store
from trainer.config import TrainerConfig
from trainer.fit.rollout_wait import cancel_quietly, deadline
from trainer.fit.train_step import Sync
from trainer.run_folder import checkpoint as ck
from trainer.run_folder.checkpoint import CheckpointManager, DataCursor, RunPlan

log = structlog.get_logger("agentloop.trainer")


async def save_checkpoint(
    config: TrainerConfig, ckpt: CheckpointManager, worker: Any, step: int, data_state: dict[str, int]
) -> None:
    """The worker's state as the checkpoint of ``step``, with the data cursor a resume restarts from."""
    path = ckpt.begin(step)
    limit = config.trainer.timeouts.save_s
    call = worker.save_checkpoint.remote(str(path))  # safetensors weights beside the optimizer state
    await deadline(call, limit, f"checkpoint {path} to be written", "save_s")
    ckpt.commit(step, {"step": step, "cursor": data_state})


async def resume(
    config: TrainerConfig,
    ckpt: CheckpointManager,
    worker: Any,
    engine: Any,
    cursor: DataCursor,
    store: Store,
    plan: RunPlan,
    *,
    sync: Sync,
) -> int:
    """The step a run starts at: 0, or the plan's checkpoint loaded into the worker, ``sync``ed into the
    engine and the data cursor restored."""
    # Rollouts a killed run left queued or running are cancelled: the resumed run re-enqueues its batch.
    stale = await store.list_rollouts(status=["queued", "requeued", "running"])
    for rollout in stale:
        await cancel_quietly(store, rollout.rollout_id)
    if plan.checkpoint is None:
        return 0
    path, state = plan.checkpoint
    limits = config.trainer.timeouts
    call = worker.load_checkpoint.remote(str(path))
    await deadline(call, limits.engine_s, f"checkpoint {path} to load", "engine_s")
    await deadline(
        sync(worker, engine),
        limits.weight_sync_s,
        "the checkpoint's weights to reach the engine",
        "weight_sync_s",
    )
    cursor.load_state(state["cursor"])
    log.warning("resumed", step=state["step"], checkpoint=str(path), cancelled_stale_rollouts=len(stale))
    return int(state["step"])


async def save_model(
    config: TrainerConfig, worker: Any, model_path: str, run_dir: Path
) -> tuple[Path, Path | None]:
    """``final_model/`` (and ``final_adapter/`` for LoRA) from the trained weights."""
    limits = config.trainer.timeouts
    model_dir = run_dir / ck.FINAL_MODEL
    lora = config.actor_rollout_ref.model.lora_rank > 0
    adapter_dir = run_dir / ck.FINAL_ADAPTER if lora else None
    call = worker.save_model.remote(model_path, str(model_dir), str(adapter_dir) if adapter_dir else None)
    await deadline(call, limits.save_s, f"the final model to be written to {model_dir}", "save_s")
    return model_dir, adapter_dir
