"""The background training loop: rollouts through the real proxy, updates in a Ray actor, weight sync.

One step (sync mode, ``rollout.max_staleness == 0``)::

    enqueue train_batch_size tasks x rollout.n ─► Runner runs the agent ─► Proxy ─► Engine
    wait_for_rollouts ─► adapter (spans -> triplets) ─► build_batch
    ─► TrainerWorker.update (Ray actor: old/ref logprobs, advantages, PPO/GRPO)
    ─► engine.update_weights(new weights) ; store.add_resources(version + 1)
       (data-parallel ranks + replica pool: straight from the ranks' GPUs, trainer/weight_sync.py)

With ``max_staleness = k > 0`` the next k batches are already enqueued while a batch trains (async
mode); each sample records the weights version it was generated with (``weights_version`` metadata).

Engine, proxy, store and runner live in the driver's event loop; the policy and its optimizer live
in a Ray actor (a GPU of its own when there is one), so the update never blocks the agents' I/O.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from agentloop.adapter import triplets_for_rollouts
from agentloop.agent import Agent
from agentloop.errors import AgentLoopError, EmptyBatchError
from agentloop.resources import Resources
from agentloop.runner import Runner, _as_agent
from agentloop.store.base import Store
from agentloop.types import Reward, RolloutConfig, RolloutStatus, Triplet
from trainer.actor import Actor, resolve_device
from trainer.batch import build_batch
from trainer.checkpoint import CheckpointManager, DataCursor
from trainer.config import TrainerConfig, engine_kwargs
from trainer.metrics import MetricsLogger, plot_curves
from trainer.placement import place, serve_store

log = structlog.get_logger("agentloop.trainer")

LLM_RESOURCE = "main_llm"


class TrainerWorker:
    """The Ray actor that owns the policy: updates, weights and checkpoints."""

    def __init__(self, config: TrainerConfig, model_path: str, device: str) -> None:
        torch.set_num_threads(max(1, os.cpu_count() or 1))  # Ray sets OMP threads to 1 for actors
        self.actor = Actor(config, model_path, device)

    def update(self, batch: Any) -> dict[str, float]:
        return self.actor.update(batch)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.actor.named_weights()

    def save(self, path: str) -> None:
        torch.save(self.actor.state(), path)

    def load(self, path: str) -> int:
        self.actor.load_state(torch.load(path, map_location=self.actor.device, weights_only=True))
        return self.actor.step


@dataclass
class FitResult:
    """What ``Trainer.fit`` returns."""

    run_dir: Path
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    val_history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Pending:
    step: int
    rollout_ids: list[str]
    enqueued_at: float
    cursor_before: dict[str, int]  # the data cursor before this batch was drawn (what a resume restarts from)


class Trainer:
    """GRPO/PPO on the triplets your agent's rollouts produce; see TrainerConfig for every key."""

    def __init__(self, config: dict[str, Any] | TrainerConfig | None = None) -> None:
        self.config = TrainerConfig.from_dict(config)
        self._weight_sync: Any = None  # a trainer.weight_sync.WeightSync while ranks feed a replica pool

    # ------------------------------------------------------------ entry point

    def fit(
        self,
        agent: Agent | Any,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None = None,
        *,
        store: Store | None = None,
        engine: Any = None,
    ) -> FitResult:
        """Train ``agent``'s model on ``train_dataset`` (a list of JSON tasks); validate on ``val_dataset``.

        ``store`` and ``engine`` default to a SQLite store in the run folder and the engine that
        ``actor_rollout_ref.model.path`` resolves to.
        """
        agent = _as_agent(agent)
        train = _check_dataset(train_dataset, "train_dataset")
        val = _check_dataset(val_dataset, "val_dataset") if val_dataset is not None else None
        bs = self.config.data.train_batch_size
        if len(train) < bs:
            raise ValueError(f"train_dataset has {len(train)} tasks, fewer than data.train_batch_size ({bs})")
        return anyio.run(self._fit, agent, train, val, store, engine)

    # ------------------------------------------------------------ the loop

    async def _fit(
        self, agent: Agent, train: list[Any], val: list[Any] | None, store: Store | None, engine: Any
    ) -> FitResult:
        from agentloop.engine.models import load_engine, resolve_model
        from agentloop.proxy import Proxy
        from agentloop.store.sqlite import SQLiteStore

        cfg = self.config
        run_dir = cfg.trainer.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        model_path = resolve_model(cfg.actor_rollout_ref.model.path)
        device = str(resolve_device(cfg.trainer.device))
        own_store = store is None
        store = store or SQLiteStore(run_dir / "store.db")
        layout = place(cfg, str(model_path), device, engine_given=engine is not None)  # ranks, replicas
        engine = (
            engine
            or layout.engine
            or load_engine(str(model_path), device=device, **engine_kwargs(cfg.actor_rollout_ref.rollout))
        )
        worker = layout.worker or _start_worker(cfg, str(model_path), device)
        ckpt = CheckpointManager(run_dir / "checkpoints")
        cursor = DataCursor(len(train), cfg.data.train_batch_size, cfg.trainer.seed)
        total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * cursor.batches_per_epoch
        metrics_log = MetricsLogger.create(
            cfg.trainer.logger,
            run_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            cfg.model_dump(),
        )
        result = FitResult(run_dir=run_dir, steps=0)
        proxy = Proxy(
            engine,
            store,
            host=cfg.placement.proxy_host,
            max_body_bytes=32 * 1024 * 1024,
            default_max_tokens=cfg.data.max_response_length,
        )
        store_server = await serve_store(cfg, store)  # None unless placement.store_server (remote runners)
        try:
            await proxy.start()
            step = await self._resume(ckpt, worker, engine, cursor, store)
            sampling = {
                "temperature": cfg.actor_rollout_ref.rollout.temperature,
                "top_p": cfg.actor_rollout_ref.rollout.top_p,
            }
            sampling["max_tokens"] = cfg.data.max_response_length
            resources = Resources(items={LLM_RESOURCE: proxy.as_resource("agentloop", sampling)})
            await store.add_resources(resources)
            runner = Runner(agent, store, concurrency=cfg.actor_rollout_ref.rollout.concurrency)
            async with anyio.create_task_group() as tg:
                if cfg.placement.local_runner:
                    tg.start_soon(runner.run)
                if val and cfg.trainer.val_before_train and step == 0:
                    result.val_history.append(await self._validate(store, val, step, metrics_log))
                pending: deque[_Pending] = deque()
                progress = _progress(total_steps, step)
                while step < total_steps:
                    while len(pending) <= cfg.actor_rollout_ref.rollout.max_staleness and (
                        step + len(pending) < total_steps
                    ):
                        pending.append(await self._enqueue(store, train, cursor, step + len(pending)))
                    batch_info = pending.popleft()
                    metrics = await self._train_step(store, worker, engine, resources, batch_info, cfg)
                    step += 1
                    metrics["step"] = step
                    if (
                        val
                        and cfg.trainer.test_freq > 0
                        and (step % cfg.trainer.test_freq == 0 or step == total_steps)
                    ):
                        val_metrics = await self._validate(store, val, step, metrics_log)
                        result.val_history.append(val_metrics)
                        metrics.update(val_metrics)
                    metrics_log.log(step, metrics)
                    result.history.append(metrics)
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
                    if cfg.trainer.save_freq > 0 and (
                        step % cfg.trainer.save_freq == 0 or step == total_steps
                    ):
                        # async mode has batches enqueued but not trained: resume re-draws them
                        data_state = pending[0].cursor_before if pending else cursor.state()
                        await self._checkpoint(ckpt, worker, step, data_state)
                progress.close()
                for p in pending:  # async mode may have enqueued beyond the last step
                    for rid in p.rollout_ids:
                        await _cancel_quietly(store, rid)
                runner.stop()
            result.steps = step
        finally:
            metrics_log.close()
            await proxy.stop()
            if store_server is not None:
                await store_server.stop()
            if self._weight_sync is not None:
                await self._weight_sync.close()
                self._weight_sync = None
            await layout.aclose()
            if own_store:
                await store.close()
        if (run_dir / "metrics.jsonl").exists():
            plot_curves(
                run_dir / "metrics.jsonl",
                run_dir / "reward_curve.png",
                keys=("reward/mean", "val/reward_mean"),
            )
        return result

    async def _enqueue(self, store: Store, train: list[Any], cursor: DataCursor, step: int) -> _Pending:
        n = self.config.actor_rollout_ref.rollout.n
        ids = []
        config = RolloutConfig(max_attempts=2, unresponsive_s=300.0)
        cursor_before = cursor.state()
        for index, task in cursor.next_batch(train):
            for sample in range(n):
                rollout = await store.enqueue_rollout(
                    task,
                    "train",
                    config=config,
                    metadata={"step": step, "data_index": index, "sample_index": sample},
                )
                ids.append(rollout.rollout_id)
        return _Pending(
            step=step, rollout_ids=ids, enqueued_at=time.perf_counter(), cursor_before=cursor_before
        )

    async def _train_step(
        self,
        store: Store,
        worker: Any,
        engine: Any,
        resources: Resources,
        pending: _Pending,
        cfg: TrainerConfig,
    ) -> dict[str, float]:
        t_wait = time.perf_counter()
        finished = await _wait_all(store, pending.rollout_ids)
        rollout_s = time.perf_counter() - pending.enqueued_at
        wait_s = time.perf_counter() - t_wait
        adapted = await triplets_for_rollouts(store, pending.rollout_ids, cfg.adapter.credit_assignment)
        triplets = adapted.triplets
        batch, batch_stats = build_batch(
            triplets,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length,
            pad_token_id=_pad_id(engine),
            merge=cfg.adapter.trajectory,
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
        }
        metrics.update(_attempt_metrics(triplets))
        versions = [v for t in triplets if (v := t.metadata.get("weights_version")) is not None]
        if versions:
            metrics["rollout/staleness_max"] = float(engine.weights_version - min(versions))
        if len(batch) == 0:
            log.warning(
                "trainer.empty_batch", step=pending.step, **{k: v for k, v in batch_stats.items() if v}
            )
            if not triplets:
                raise EmptyBatchError(
                    f"step {pending.step}: no triplets from {len(pending.rollout_ids)} rollouts "
                    f"({metrics['rollout/failed']:.0f} failed); does the agent call the LLM through llm.base_url?"
                )
            return metrics
        t_update = time.perf_counter()
        metrics.update(await worker.update.remote(batch))
        metrics["timing/update_wall_s"] = time.perf_counter() - t_update
        t_sync = time.perf_counter()
        version, sync_metrics = await self._sync_weights(worker, engine)
        metrics.update(sync_metrics)
        await store.add_resources(Resources(items=resources.items))
        metrics["timing/sync_s"] = time.perf_counter() - t_sync
        metrics["weights_version"] = float(version)
        tokens = int(batch.attention_mask.sum())
        metrics["perf/rollout_tokens"] = float(tokens)
        metrics["timing/step_s"] = time.perf_counter() - t_wait
        return metrics

    async def _sync_weights(self, worker: Any, engine: Any) -> tuple[int, dict[str, float]]:
        """New weights into the engine: data-parallel ranks straight into a replica pool (CUDA IPC /
        NCCL, trainer/weight_sync.py), else through the driver (``engine.update_weights``)."""
        from trainer import weight_sync

        if weight_sync.supports(worker, engine):
            if self._weight_sync is None:
                self._weight_sync = weight_sync.WeightSync(worker, engine)
            report = await self._weight_sync.sync()
            return report.version, report.metrics()
        return int(await engine.update_weights(await worker.named_weights.remote())), {}

    async def _validate(
        self, store: Store, val: list[Any], step: int, metrics_log: MetricsLogger
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        ids = [(await store.enqueue_rollout(task, "val", metadata={"step": step})).rollout_id for task in val]
        finished = await _wait_all(store, ids)
        rewards = []
        for rollout in finished:
            if rollout.status is RolloutStatus.SUCCEEDED:
                spans = await store.query_spans(rollout.rollout_id, "latest")
                rewards.append(sum(s.payload.value for s in spans if isinstance(s.payload, Reward)))
            else:
                rewards.append(0.0)
        mean = sum(rewards) / max(len(rewards), 1)
        metrics = {
            "val/reward_mean": mean,
            "val/success_rate": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
            "timing/val_s": time.perf_counter() - t0,
            "val/step": float(step),
        }
        log.info("validation", step=step, **{k: round(v, 4) for k, v in metrics.items()})
        if step == 0:
            metrics_log.log(0, metrics)
        return metrics

    # ------------------------------------------------------------ checkpoints

    async def _checkpoint(
        self, ckpt: CheckpointManager, worker: Any, step: int, data_state: dict[str, int]
    ) -> None:
        path = ckpt.begin(step)
        await worker.save.remote(str(path / "actor.pt"))
        ckpt.commit(step, {"step": step, "cursor": data_state})

    async def _resume(
        self, ckpt: CheckpointManager, worker: Any, engine: Any, cursor: DataCursor, store: Store
    ) -> int:
        # Rollouts a killed run left queued or running are cancelled: the resumed run re-enqueues its batch.
        stale = await store.list_rollouts(status=["queued", "requeued", "running"])
        for rollout in stale:
            await _cancel_quietly(store, rollout.rollout_id)
        mode = self.config.trainer.resume
        if mode == "disable":
            return 0
        found = ckpt.latest() if mode == "auto" else ckpt.load_path(Path(mode))
        if found is None:
            return 0
        path, state = found
        await worker.load.remote(str(path / "actor.pt"))
        await self._sync_weights(worker, engine)
        cursor.load_state(state["cursor"])
        log.info("resumed", step=state["step"], checkpoint=str(path), cancelled_stale_rollouts=len(stale))
        return int(state["step"])


# ---------------------------------------------------------------- helpers


def _start_worker(config: TrainerConfig, model_path: str, device: str) -> Any:
    import ray

    if not ray.is_initialized():
        ray.init(
            address=config.trainer.ray_address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
            configure_logging=False,
        )
    gpus = 1 if device.startswith("cuda") else 0
    remote_cls = ray.remote(num_cpus=0, num_gpus=gpus)(TrainerWorker)
    return remote_cls.remote(config, model_path, device)


async def _wait_all(store: Store, rollout_ids: list[str], poll_s: float = 5.0) -> list[Any]:
    """Wait until every rollout is terminal (the runner's watchdog and retries bound the wait)."""
    remaining = set(rollout_ids)
    done: dict[str, Any] = {}
    while remaining:
        for rollout in await store.wait_for_rollouts(sorted(remaining), timeout=poll_s):
            done[rollout.rollout_id] = rollout
            remaining.discard(rollout.rollout_id)
        if remaining:
            await store.check_timeouts()
    return [done[r] for r in rollout_ids]


async def _cancel_quietly(store: Store, rollout_id: str) -> None:
    try:
        await store.cancel_rollout(rollout_id)
    except AgentLoopError:  # already finished
        pass


def _attempt_metrics(triplets: list[Triplet]) -> dict[str, float]:
    """Reward per attempt (each attempt once, whatever its number of calls), calls per attempt and
    response length per call."""
    rewards: dict[str, float] = {}
    calls: dict[str, int] = {}
    for i, t in enumerate(triplets):
        key = str(t.metadata.get("attempt_id", f"triplet:{i}"))
        calls[key] = calls.get(key, 0) + 1
        total = t.metadata.get("attempt_reward", t.reward)
        if total is not None:
            rewards[key] = float(total)
    if not rewards:
        return {}
    rt = torch.tensor(list(rewards.values()))
    return {
        "reward/mean": float(rt.mean()),
        "reward/std": float(rt.std(unbiased=False)),
        "rollout/calls_per_attempt": sum(calls.values()) / len(calls),
        "response/length_mean": sum(len(t.response_ids) for t in triplets) / len(triplets),
    }


def _pad_id(engine: Any) -> int:
    tok = engine.tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)


def _check_dataset(data: Sequence[Any] | None, name: str) -> list[Any]:
    if data is None or isinstance(data, str | bytes) or not isinstance(data, Sequence):
        raise TypeError(f"{name} must be a list of JSON tasks, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{name} is empty; give at least one task")
    for i, task in enumerate(data):
        try:
            json.dumps(task)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}[{i}] is not JSON-serialisable ({exc}); tasks travel through the store"
            ) from None
    return list(data)


def _progress(total: int, initial: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True)


__all__ = ["FitResult", "Trainer", "TrainerWorker"]
