"""Supervised fine-tuning on recorded trajectories: warm-start a model on good rollouts before RL.

::

    store (a run folder's store.db, any SQLite store file, or a Store) ─► chosen attempts:
        mode in sft.modes, succeeded (sft.include_failed: any status), reward >= sft.min_reward
    ─► adapter: spans -> triplets (the exact recorded token ids, never re-tokenized), an attempt's
       calls merged where each prompt extends the last (tool results and template tokens: mask 0)
    ─► held-out tasks (sft.val_fraction, whole tasks) ─► build_batch ─► SFTActor.nll_step:
       token-level NLL on response_mask tokens only, aggregated by actor.loss_agg_mode
    ─► metrics.jsonl, loss_curve.png, checkpoints/, final_model/ (a Hugging Face folder)

The config tree is the RL trainer's (``TrainerConfig``, verl keys) plus an ``sft`` section
(``SFTConfig``). What each key means here:

- ``actor_rollout_ref.model.path`` (and ``lora_*``): the model trained; ``actor.optim.*``, ``grad_clip``,
  ``loss_agg_mode``, ``ppo_max_token_len_per_gpu`` (the micro-batch token budget) as in RL;
- ``data.train_batch_size``: attempts per optimizer step (an attempt is one sample once merged);
  ``data.max_prompt_length``: an attempt with a longer prompt is left out whole (counted);
  ``data.max_response_length``: longer merged samples are truncated (counted);
- ``trainer.total_epochs`` / ``total_training_steps``, ``save_freq``, ``test_freq`` (validation NLL),
  ``resume``, ``seed`` (data order and split), ``logger``, ``device``, the run folder: as in RL.
  The run folder defaults to ``runs/<project>/sft`` (not RL's ``default``).

The NLL is the model's own (logits at temperature 1), whatever temperature a call was sampled at:
the served model applies the sampling temperature itself. The calls of an attempt are always merged
(what ``adapter.trajectory`` does in RL): a token's context is the same as in its own call, computed
once. The run folder is the RL trainer's (trainer/run_folder/checkpoint.py): ``run.json``, ``config.json`` (with
the ``sft`` section), checkpoints that resume (``trainer.resume``), and ``final_model/`` that
``actor_rollout_ref.model.path`` of an RL run (``Trainer.fit``, ``agentloop train``) starts from.
No critic, reference model or KL term is built: a config that asks for them is trained without.

This module is the run; its parts, in this folder: ``config`` (the ``sft`` section, ``load_configs``),
``data`` (choosing attempts, the split, the batch) and ``actor`` (the NLL step). Their public
names are imported from here.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from agentloop.errors import ConfigError, EmptyBatchError
from agentloop.private_files import private_dir, write_private_text
from agentloop.store.base import Store
from agentloop.types import Triplet
from trainer.config import TrainerConfig
from trainer.distributed.worker import TrainerWorker
from trainer.model.actor import Actor
from trainer.run_folder import checkpoint as ck
from trainer.run_folder.metrics import MetricsLogger, plot_curves
from trainer.sft.actor import SFTActor
from trainer.sft.config import SFTConfig, load_configs, sft_trainer_config
from trainer.sft.data import Selection, _batch, open_store, select_attempts, split_tasks

log = structlog.get_logger("agentloop.trainer.sft")

LOSS_PLOT = "loss_curve.png"


@dataclass
class SFTResult:
    """What ``run_sft`` returns."""

    run_dir: Path  # metrics.jsonl, loss_curve.png, checkpoints/, final_model/
    steps: int  # the step the run ended at (counting the steps of a run it resumed)
    model_dir: Path | None = None  # the trained model, a Hugging Face folder RL can start from
    adapter_dir: Path | None = None  # LoRA runs: the peft adapter (model_dir holds it merged)
    history: list[dict[str, float]] = field(default_factory=list)  # one row per step this call trained
    metrics: dict[str, float] = field(default_factory=dict)  # the last step's metrics + last validation
    train_attempts: int = 0
    val_attempts: int = 0
    resumed_from: int | None = None
    already_finished: bool = False


def run_sft(
    store: str | Path | Store,
    config: dict[str, Any] | TrainerConfig | None = None,
    sft: dict[str, Any] | SFTConfig | None = None,
) -> SFTResult:
    """Fine-tune ``actor_rollout_ref.model.path`` on the chosen attempts of ``store`` (module docstring).

    ``store``: a run folder (its ``store.db``), a store file, or a Store object (read in a fresh event
    loop: call from synchronous code). Returns the run folder and ``model_dir`` (``final_model/``), the
    model an RL run warm-starts from: ``{"actor_rollout_ref": {"model": {"path": str(model_dir)}}}``.
    """
    from transformers import AutoTokenizer

    from agentloop.engine.models import resolve_model

    cfg, sft_cfg = load_configs(config, sft)
    model_path = resolve_model(cfg.actor_rollout_ref.model.path)
    chosen = anyio.run(_read, store, sft_cfg, cfg.adapter.credit_assignment)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)
    train_idx, val_idx = split_tasks(chosen.tasks, sft_cfg.val_fraction, cfg.trainer.seed)
    train = [chosen.attempts[i] for i in train_idx]
    val = [chosen.attempts[i] for i in val_idx]
    bs = cfg.data.train_batch_size
    if len(train) < bs:
        raise ConfigError(
            f"{len(train)} training attempts ({len(chosen.attempts)} chosen, {len(val)} held out) cannot "
            f"fill data.train_batch_size ({bs}); set data.train_batch_size to {max(len(train), 1)} or less, "
            "or record more rollouts"
        )
    dump = {**cfg.model_dump(mode="json"), "sft": sft_cfg.model_dump(mode="json")}
    identity = ck.run_identity(dump, _digest(train), _digest(val))
    plan = ck.plan_run(cfg.trainer.run_dir, cfg.trainer.resume, identity, dump)
    if plan.action == "finished":
        log.warning("sft run already finished; returning its result", run_dir=str(plan.run_dir))
        return _finished(plan)
    log.warning("writing sft run", run_dir=str(plan.run_dir), attempts=len(train), held_out=len(val))
    actor = SFTActor(sft_trainer_config(cfg), model_path, cfg.trainer.device)
    _check_vocab(chosen.attempts, actor)
    return _train(cfg, plan, identity, actor, train, val, pad, str(model_path), dump)


async def _read(store: str | Path | Store, sft: SFTConfig, strategy: Any) -> Selection:
    own = isinstance(store, str | Path)
    opened: Store = open_store(store) if isinstance(store, str | Path) else store
    try:
        return await select_attempts(opened, sft, strategy)
    finally:
        if own:
            await opened.close()


def _digest(attempts: list[list[Triplet]]) -> str:
    h = hashlib.sha256()
    for attempt in attempts:
        for t in attempt:
            h.update(json.dumps([t.prompt_ids, t.response_ids, t.response_mask]).encode())
    return h.hexdigest()[:16]


def _check_vocab(attempts: list[list[Triplet]], actor: Actor) -> None:
    """The recorded ids must be ids of this model's vocabulary (the same tokenizer recorded them)."""
    vocab = int(actor.model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    top = max(max(t.prompt_ids + t.response_ids) for attempt in attempts for t in attempt)
    if top >= vocab:
        raise ConfigError(
            f"the store's token ids go up to {top} but {actor.config.actor_rollout_ref.model.path} has "
            f"{vocab} embeddings: these rollouts were recorded with another model's tokenizer; train the "
            "model that recorded them (the run's actor_rollout_ref.model.path)"
        )


def _train(
    cfg: TrainerConfig,
    plan: ck.RunPlan,
    identity: str,
    actor: SFTActor,
    train: list[list[Triplet]],
    val: list[list[Triplet]],
    pad: int,
    model_path: str,
    dump: dict[str, Any],
) -> SFTResult:
    from tqdm.auto import tqdm

    run = cfg.trainer
    run_dir = plan.run_dir
    record, cursor, total = _start_run(cfg, plan, identity, len(train), len(val), dump)
    ckpt = ck.CheckpointManager(run_dir / "checkpoints")
    worker = _Worker(actor)
    step = _resume(plan, worker, cursor)
    val_batch = _batch(val, cfg, pad)[0] if val else None
    metrics_log = MetricsLogger.create(run.logger, run_dir, run.project_name, run.experiment_name, dump)
    result = SFTResult(
        run_dir=run_dir,
        steps=step,
        train_attempts=len(train),
        val_attempts=len(val),
        resumed_from=step if plan.action == "resume" else None,
    )
    last_val: dict[str, float] = {}
    try:
        if val_batch is not None and run.val_before_train and step == 0:
            last_val = {"val/nll": actor.mean_nll(val_batch)}
            metrics_log.log(0, last_val)
        progress = tqdm(total=total, initial=step, desc="sft", unit="step", dynamic_ncols=True)
        while step < total:
            t0 = time.perf_counter()
            batch, stats = _batch([a for _, a in cursor.next_batch(train)], cfg, pad)
            epoch = cursor.epoch  # next_batch moved to the next epoch first when this one was used up
            if len(batch) == 0 or not bool(batch.response_mask.any()):
                raise EmptyBatchError(
                    f"step {step + 1}: no trainable token in the batch ({_dropped(stats)}); raise "
                    "data.max_prompt_length or data.max_response_length"
                )
            metrics = actor.nll_step(batch)
            step += 1
            metrics.update(epoch=float(epoch), step=float(step))
            metrics.update(
                {f"batch/{k}": float(v) for k, v in stats.items() if k.startswith(("dropped", "trunc"))}
            )
            last = step == total
            if val_batch is not None and (last or (run.test_freq > 0 and step % run.test_freq == 0)):
                last_val = {"val/nll": actor.mean_nll(val_batch)}
                metrics.update(last_val)
            metrics["timing/step_s"] = time.perf_counter() - t0
            metrics_log.log(step, metrics)
            result.history.append(metrics)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
            if run.save_freq > 0 and (step % run.save_freq == 0 or last):
                worker.save_checkpoint(str(ckpt.begin(step)))
                ckpt.commit(step, {"step": step, "cursor": cursor.state()})
                record["step"] = step
                ck.write_run(run_dir, record)
        progress.close()
    finally:
        metrics_log.close()
    _finish(cfg, plan.run_dir, worker, model_path, result, record, step, last_val)
    return result


def _start_run(
    cfg: TrainerConfig, plan: ck.RunPlan, identity: str, n_train: int, n_val: int, dump: dict[str, Any]
) -> tuple[dict[str, Any], ck.DataCursor, int]:
    """The run folder made private with its config.json and run record; returns the record, the data
    cursor and the number of steps to train."""
    run, run_dir = cfg.trainer, plan.run_dir
    private_dir(run_dir)  # 0700: the training data and the checkpoints (agentloop.private_files)
    write_private_text(run_dir / "config.json", json.dumps(dump, indent=2))
    record: dict[str, Any] = {"identity": identity, "kind": "sft", "status": "running", "step": plan.step}
    cursor = ck.DataCursor(n_train, cfg.data.train_batch_size, run.seed)
    total = run.total_training_steps or run.total_epochs * cursor.batches_per_epoch
    record.update(total_steps=total, train_attempts=n_train, val_attempts=n_val)
    ck.write_run(run_dir, record)
    return record, cursor, total


def _resume(plan: ck.RunPlan, worker: _Worker, cursor: ck.DataCursor) -> int:
    """The step to start at: the plan's checkpoint loaded into ``worker`` and ``cursor``, else 0."""
    if plan.action != "resume" or plan.checkpoint is None:
        return 0
    path, state = plan.checkpoint
    worker.load_checkpoint(str(path))
    cursor.load_state(state["cursor"])
    step = int(state["step"])
    dropped = ck.keep_metrics_until(plan.run_dir / "metrics.jsonl", step)
    log.warning("sft resumed", step=step, checkpoint=str(path), metrics_lines_dropped=dropped)
    return step


def _finish(
    cfg: TrainerConfig,
    run_dir: Path,
    worker: _Worker,
    model_path: str,
    result: SFTResult,
    record: dict[str, Any],
    step: int,
    last_val: dict[str, float],
) -> None:
    """The trained model saved, the loss curves plotted, ``result`` and the run record finished."""
    result.steps = step
    result.model_dir = run_dir / ck.FINAL_MODEL
    result.adapter_dir = run_dir / ck.FINAL_ADAPTER if cfg.actor_rollout_ref.model.lora_rank > 0 else None
    worker.save_model(
        model_path, str(result.model_dir), str(result.adapter_dir) if result.adapter_dir else None
    )
    if (run_dir / "metrics.jsonl").exists():
        plot_curves(run_dir / "metrics.jsonl", run_dir / LOSS_PLOT, keys=("sft/loss", "val/nll"))
    result.metrics = {**(result.history[-1] if result.history else {}), **last_val}
    record.update(
        status="finished",
        step=step,
        model_dir=ck.FINAL_MODEL,
        adapter_dir=ck.FINAL_ADAPTER if result.adapter_dir else None,
        metrics=result.metrics,
    )
    ck.write_run(run_dir, record)
    log.info("sft finished", run_dir=str(run_dir), steps=step, model_dir=str(result.model_dir))


class _Worker(TrainerWorker):
    """The RL trainer's worker around the SFT actor, in this process: the same checkpoint files (save
    and resume) and the same final_model/ (and final_adapter/) export."""

    def __init__(self, actor: SFTActor) -> None:  # the actor is built already (no Ray, no thread setup)
        self.actor = actor


def _dropped(stats: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in stats.items() if k.startswith("dropped") and v) or "none dropped"


def _finished(plan: ck.RunPlan) -> SFTResult:
    """The result of an SFT run that finished before, read from its folder."""
    from trainer.run_folder.metrics import read_metrics

    record = plan.record or {}
    adapter = record.get("adapter_dir")
    return SFTResult(
        run_dir=plan.run_dir,
        steps=int(record.get("step", 0)),
        model_dir=plan.run_dir / record.get("model_dir", ck.FINAL_MODEL),
        adapter_dir=plan.run_dir / adapter if adapter else None,
        history=[r for r in read_metrics(plan.run_dir / "metrics.jsonl") if r.get("step", 0) >= 1],
        metrics=dict(record.get("metrics") or {}),
        train_attempts=int(record.get("train_attempts", 0)),
        val_attempts=int(record.get("val_attempts", 0)),
        already_finished=True,
    )


__all__ = ["SFTActor", "SFTConfig", "SFTResult", "open_store", "run_sft", "select_attempts", "split_tasks"]
