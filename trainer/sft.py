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
once. The run folder is the RL trainer's (trainer/checkpoint.py): ``run.json``, ``config.json`` (with
the ``sft`` section), checkpoints that resume (``trainer.resume``), and ``final_model/`` that
``actor_rollout_ref.model.path`` of an RL run (``Trainer.fit``, ``agentloop train``) starts from.
No critic, reference model or KL term is built: a config that asks for them is trained without.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sqlite3
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import structlog
from pydantic import Field, ValidationError

from agentloop.adapter import spans_to_triplets
from agentloop.errors import ConfigError, EmptyBatchError
from agentloop.store.base import Store
from agentloop.types import Attempt, AttemptStatus, Rollout, RolloutStatus, Triplet
from trainer import checkpoint as ck
from trainer.actor import Actor, _local_count
from trainer.algorithms import agg_loss, attempt_row_weights
from trainer.batch import Batch, build_batch
from trainer.config import TrainerConfig, _Section, format_validation_error
from trainer.metrics import MetricsLogger, plot_curves
from trainer.ray_trainer import TrainerWorker

log = structlog.get_logger("agentloop.trainer.sft")

LOSS_PLOT = "loss_curve.png"


class SFTConfig(_Section):
    """Which recorded attempts SFT trains on, and the held-out split (the ``sft`` section)."""

    min_reward: float | None = Field(
        default=1.0, description="Train on attempts whose total reward is at least this; None: any reward."
    )
    modes: list[Literal["train", "val"]] = Field(
        default=["train"], min_length=1, description="Rollout modes to take attempts from."
    )
    include_failed: bool = Field(
        default=False,
        description="Also attempts that did not succeed (a retried rollout's earlier ones) whose reward "
        "passes; False: the succeeded attempt of each succeeded rollout only.",
    )
    val_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="Share of the tasks held out for validation NLL (whole tasks)."
    )


class _SFTRoot(_Section):
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The sft section (errors name sft.KEY).")


# ---------------------------------------------------------------- choosing the data


@dataclass
class Selection:
    """The chosen attempts (each a list of merged samples) and what the store held."""

    attempts: list[list[Triplet]]
    tasks: list[str]  # the task key of each attempt (its rollout input as JSON)
    seen: Counter[str] = field(default_factory=Counter)  # "mode/status" -> rollouts
    rewards: Counter[str] = field(default_factory=Counter)  # reward of the attempts of the right mode


def open_store(path: str | Path) -> Store:
    """A SQLiteStore on an existing agentloop store: the file, or a run folder's ``store.db``.

    Checked read-only first: a missing path or a file that is not an agentloop store is an error,
    never a new store (SQLiteStore creates what it does not find)."""
    from agentloop.store.sqlite import SQLiteStore

    p = Path(path)
    if p.is_dir():
        p = p / "store.db"
    if not p.is_file():
        where = "has no store.db" if p.name == "store.db" and p.parent.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"store {str(path)!r} {where}; give a run folder written by training or a store file"
        )
    try:
        conn = sqlite3.connect("file:" + urllib.parse.quote(str(p.resolve())) + "?mode=ro", uri=True)
        try:
            conn.execute("SELECT 1 FROM rollouts LIMIT 1")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise ValueError(f"{p} is not an agentloop store ({exc})") from None
    return SQLiteStore(p)


async def select_attempts(store: Store, sft: SFTConfig, strategy: Any = "identical") -> Selection:
    """The attempts of ``store`` that pass ``sft``'s filters, as merged samples (adapter.merge_turns).

    Raises EmptyBatchError when none does, naming what the store holds (modes, statuses, rewards)."""
    from agentloop.adapter import merge_turns

    chosen = Selection(attempts=[], tasks=[])
    for rollout in await store.list_rollouts():
        chosen.seen[f"{rollout.mode}/{rollout.status.value}"] += 1
        if rollout.mode not in sft.modes or not rollout.num_attempts:
            continue
        for attempt_id in await _attempt_ids(store, rollout, sft.include_failed):
            spans = await store.query_spans(rollout.rollout_id, attempt_id)
            triplets = spans_to_triplets(spans, strategy, rollout=rollout).triplets
            reward = _attempt_reward(triplets)
            chosen.rewards["none" if reward is None else f"{reward:g}"] += 1
            if not triplets or (sft.min_reward is not None and (reward is None or reward < sft.min_reward)):
                continue
            chosen.attempts.append(
                merge_turns([t.model_copy(update={"reward": reward or 0.0}) for t in triplets])
            )
            chosen.tasks.append(json.dumps(rollout.input, sort_keys=True, default=str))
    if not chosen.attempts:
        raise EmptyBatchError(_nothing_matches(chosen, sft))
    return chosen


async def _attempt_ids(store: Store, rollout: Rollout, include_failed: bool) -> list[str]:
    if not include_failed:
        if rollout.status is not RolloutStatus.SUCCEEDED:
            return []
        return ["latest"]  # a rollout ends at its first succeeded attempt: the latest one
    attempts: list[Attempt] = await store.list_attempts(rollout.rollout_id)
    active = (AttemptStatus.PREPARING, AttemptStatus.RUNNING)
    return [a.attempt_id for a in attempts if a.status not in active]


def _attempt_reward(triplets: list[Triplet]) -> float | None:
    """The attempt's total reward (the sum of its Reward spans), None without one."""
    for t in triplets:
        total = t.metadata.get("attempt_reward")
        if isinstance(total, int | float):
            return float(total)
    return None


def _nothing_matches(chosen: Selection, sft: SFTConfig) -> str:
    total = sum(chosen.seen.values())
    if not total:
        return "the store holds no rollouts; record some first (agentloop train, a Runner, agentloop serve --train)"
    held = ", ".join(f"{n} {k}" for k, n in sorted(chosen.seen.items()))
    rewards = ", ".join(f"{k} x {n}" for k, n in sorted(chosen.rewards.items(), key=lambda kv: kv[0]))
    which = "attempts" if sft.include_failed else "succeeded attempts"
    got = f"their {which} scored: {rewards}" if rewards else f"none of them has {which} in modes {sft.modes}"
    fixes = [] if sft.min_reward is None else [f"lower --min-reward (sft.min_reward, now {sft.min_reward:g})"]
    if sft.modes == ["train"]:
        fixes.append("add --mode val")
    if not sft.include_failed:
        fixes.append("--include-failed")
    return (
        f"no attempt passes the filter (modes {sft.modes}, min_reward {sft.min_reward}); the store holds "
        f"{total} rollouts ({held}); {got}; to train on more: {', '.join(fixes) or 'record better rollouts'}"
    )


def split_tasks(tasks: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Attempt indices (train, val): whole tasks held out, chosen by a seeded shuffle of the distinct tasks;
    at least one task trains. Deterministic for a seed and the same data."""
    distinct = sorted(set(tasks))
    random.Random(seed).shuffle(distinct)
    n_val = min(math.ceil(val_fraction * len(distinct)), len(distinct) - 1) if val_fraction > 0 else 0
    held = set(distinct[:n_val])
    train = [i for i, t in enumerate(tasks) if t not in held]
    val = [i for i, t in enumerate(tasks) if t in held]
    return train, val


# ---------------------------------------------------------------- the loss


class SFTActor(Actor):
    """The policy and its optimizer, trained by NLL instead of a policy loss; the Actor's forward,
    micro-batching, warm-up, clipping, weights and checkpoints as they are."""

    def nll_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``: the NLL of its response_mask tokens (mask 0: tool output,
        template, padding: never trained), aggregated by ``actor.loss_agg_mode`` over the whole batch
        while micro-batches accumulate gradients."""
        actor = self.config.actor_rollout_ref.actor
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        mask = batch.response_mask.bool()  # (B, R)
        agg = actor.loss_agg_mode
        denom = _local_count(mask, agg)  # one denominator for the batch: micro-batches add up to it
        if agg == "attempt-mean-token-mean":
            batch.extras["row_weights"] = attempt_row_weights(mask, batch.row_attempts())
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb, _rows in self._split_micro_batches(batch):
            logprobs, _ = self._forward(self.model, mb, entropy=False)  # (b, r)
            nll = agg_loss(
                -logprobs, mb.response_mask, agg, denominator=denom, row_weights=mb.extras.get("row_weights")
            )
            nll.backward()
            loss_sum += float(nll.detach())  # note: CPU-GPU sync
        grad_norm = self._apply_gradients()
        self.step += 1
        tokens = float(mask.sum())
        elapsed = time.perf_counter() - t0
        return {
            "sft/loss": loss_sum,
            "sft/tokens": tokens,
            "sft/samples": float(len(batch)),
            "actor/grad_norm": grad_norm,
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "timing/update_s": elapsed,
            "perf/update_tokens_per_s": float(batch.attention_mask.sum()) / max(elapsed, 1e-9),
        }

    def mean_nll(self, batch: Batch) -> float:
        """Token-mean NLL of ``batch``'s response_mask tokens under the current weights (no gradient)."""
        batch = batch.to(self.device)
        logprobs = self.compute_logprobs(batch)  # (B, R), 0 where masked
        return float(-logprobs.sum() / batch.response_mask.sum().clamp(min=1))


def sft_trainer_config(config: TrainerConfig) -> TrainerConfig:
    """``config`` as the SFT actor uses it: no critic, no reference model, no KL term."""
    out = config.model_copy(deep=True)
    arr = out.actor_rollout_ref
    dropped = [
        name
        for name, on in (
            ("critic", config.uses_critic),
            ("actor_rollout_ref.actor.use_kl_loss", arr.actor.use_kl_loss),
            ("algorithm.use_kl_in_reward", out.algorithm.use_kl_in_reward),
        )
        if on
    ]
    if dropped:
        log.warning("sft.ignores", keys=dropped, why="SFT trains the policy alone")
    out.critic.enable = False
    arr.actor.use_kl_loss = False
    out.algorithm.use_kl_in_reward = False
    return out


# ---------------------------------------------------------------- the run


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


def load_configs(
    config: dict[str, Any] | TrainerConfig | None, sft: dict[str, Any] | SFTConfig | None = None
) -> tuple[TrainerConfig, SFTConfig]:
    """The trainer config and the ``sft`` section, from one dict (``sft`` as a key in it) or two."""
    data = json.loads(json.dumps(config)) if isinstance(config, dict) else config
    section = data.pop("sft", None) if isinstance(data, dict) else None
    if isinstance(data, dict) and isinstance(data.get("data"), dict) and "train_batch_size" in data["data"]:
        # RL's mini-batch must divide its batch; SFT has one optimizer step per batch: one mini-batch
        actor = data.setdefault("actor_rollout_ref", {}).setdefault("actor", {})
        if isinstance(actor, dict):
            actor.setdefault("ppo_mini_batch_size", data["data"]["train_batch_size"])
    if sft is None:
        sft = section
    elif section is not None:
        raise ConfigError("the sft section is given twice: in the config dict and as sft=; give it once")
    cfg = TrainerConfig.from_dict(data)
    if not isinstance(sft, SFTConfig):
        try:
            sft = _SFTRoot.model_validate({"sft": sft or {}}).sft
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, _SFTRoot)) from None
    if "experiment_name" not in cfg.trainer.model_fields_set:  # not RL's runs/<project>/default
        cfg = cfg.model_copy(deep=True)
        cfg.trainer.experiment_name = "sft"
    return cfg, sft


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


def _batch(attempts: Sequence[list[Triplet]], cfg: TrainerConfig, pad: int) -> tuple[Batch, dict[str, int]]:
    batch, stats = build_batch(
        [t for attempt in attempts for t in attempt],
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        pad_token_id=pad,
    )
    return replace(batch, temperatures=None), stats  # the model's own NLL: logits at temperature 1


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
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dump, indent=2))
    record: dict[str, Any] = {"identity": identity, "kind": "sft", "status": "running", "step": plan.step}
    ckpt = ck.CheckpointManager(run_dir / "checkpoints")
    cursor = ck.DataCursor(len(train), cfg.data.train_batch_size, run.seed)
    total = run.total_training_steps or run.total_epochs * cursor.batches_per_epoch
    record.update(total_steps=total, train_attempts=len(train), val_attempts=len(val))
    ck.write_run(run_dir, record)
    step = 0
    worker = _Worker(actor)
    if plan.action == "resume" and plan.checkpoint is not None:
        path, state = plan.checkpoint
        worker.load_checkpoint(str(path))
        cursor.load_state(state["cursor"])
        step = int(state["step"])
        dropped = ck.keep_metrics_until(run_dir / "metrics.jsonl", step)
        log.warning("sft resumed", step=step, checkpoint=str(path), metrics_lines_dropped=dropped)
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
    return result


class _Worker(TrainerWorker):
    """The RL trainer's worker around the SFT actor, in this process: the same checkpoint files (save
    and resume) and the same final_model/ (and final_adapter/) export."""

    def __init__(self, actor: SFTActor) -> None:  # the actor is built already (no Ray, no thread setup)
        self.actor = actor


def _dropped(stats: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in stats.items() if k.startswith("dropped") and v) or "none dropped"


def _finished(plan: ck.RunPlan) -> SFTResult:
    """The result of an SFT run that finished before, read from its folder."""
    from trainer.metrics import read_metrics

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
