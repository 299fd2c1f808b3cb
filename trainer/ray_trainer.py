"""The background training loop: rollouts through the real proxy, updates in a Ray actor, weight sync.

One step (sync mode, ``rollout.max_staleness == 0``)::

    enqueue train_batch_size tasks x rollout.n ─► Runner runs the agent ─► Proxy ─► Engine
    wait_for_rollouts ─► adapter (spans -> triplets) ─► build_batch
    ─► TrainerWorker.update (Ray actor: old/ref logprobs, advantages, PPO/GRPO)
    ─► engine.update_weights(new weights) ; store.add_resources(version + 1)
       (data-parallel ranks + replica pool: straight from the ranks' GPUs, trainer/weight_sync.py;
        worker and engine on one GPU: CUDA IPC, trainer/local_sync.py)

With ``max_staleness = k > 0`` the next k batches are already enqueued while a batch trains (async
mode); each sample records the weights version it was generated with (``weights_version`` metadata).

Engine, proxy, store and runner live in the driver's event loop; the policy and its optimizer live
in a Ray actor (a GPU of its own when there is one), so the update never blocks the agents' I/O.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog
import torch

from agentloop import event_loop
from agentloop.adapter import group_by_attempt, triplets_for_rollouts
from agentloop.agent import Agent
from agentloop.errors import EmptyBatchError, TrainerTimeoutError
from agentloop.resources import Resources
from agentloop.runner import Runner, _as_agent
from agentloop.store.base import Store
from agentloop.types import Reward, RolloutConfig, RolloutStatus, Triplet
from trainer import checkpoint as ck
from trainer import local_sync, weight_sync
from trainer.actor import resolve_device
from trainer.batch import build_batch
from trainer.checkpoint import CheckpointManager, DataCursor, RunPlan
from trainer.config import TrainerConfig, engine_kwargs
from trainer.fit_stop import FitState, Stopped, clean_stop, single_error
from trainer.metrics import MetricsLogger, plot_curves, read_metrics
from trainer.placement import init_ray, place, serve_store
from trainer.rollout_wait import cancel_quietly, deadline, failure_summary, wait_all
from trainer.worker import TrainerWorker

if TYPE_CHECKING:
    from agentloop.proxy import Proxy

log = structlog.get_logger("agentloop.trainer")

LLM_RESOURCE = "main_llm"


@dataclass
class FitResult:
    """What ``Trainer.fit`` returns."""

    run_dir: Path  # everything the run wrote: metrics.jsonl, checkpoints/, final_model/, store.db
    steps: int  # the step the run ended at (counting steps of the run it resumed)
    history: list[dict[str, float]] = field(default_factory=list)  # one row per step this call trained
    val_history: list[dict[str, float]] = field(default_factory=list)
    model_dir: Path | None = None  # the trained model, a Hugging Face folder (AutoModelForCausalLM, serve)
    adapter_dir: Path | None = None  # LoRA runs: the peft adapter (model_dir holds it merged)
    metrics: dict[str, float] = field(default_factory=dict)  # the last step's metrics + last validation
    resumed_from: int | None = None  # the checkpoint step this call continued from
    already_finished: bool = False  # the run had finished before: nothing was trained, its result returned


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
        self._local_sync: local_sync.LocalIPCSync | bool | None = None  # one GPU: None until decided
        self._reward: Any = None  # fit(reward=...): an agentloop.judge.RewardJudge
        self._judge: Any = None  # this run's copy of it (verdicts kept in <run folder>/judge.jsonl)
        self._served: Any = None  # (the proxy's session route as an LLM, the engine): a judge without llm

    # ------------------------------------------------------------ entry point

    def fit(
        self,
        agent: Agent | Any,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None = None,
        *,
        store: Store | None = None,
        engine: Any = None,
        reward: Any = None,
    ) -> FitResult:
        """Train ``agent``'s model on ``train_dataset`` (a list of JSON tasks); validate on ``val_dataset``
        before the first step and after the last (greedy, ``rollout.val_kwargs``).

        ``reward=al.judge_reward(...)``: once a step's rollouts finished, an LLM judge scores the
        attempts at each task relative to each other and each score is stored as a Reward span (see
        agentloop/judge/); the agent returns None, or a value added to the judge's score.

        Returns the run folder, the metrics and ``model_dir``: the trained model as a Hugging Face folder
        (``<run folder>/final_model``). The run folder follows the one-run-one-folder rule of
        trainer/checkpoint.py: a finished run of this config and data is returned at once, a stopped one
        resumes from its checkpoint, and a folder holding another run is left alone. ``store`` and
        ``engine`` default to a SQLite store in the run folder and the engine that
        ``actor_rollout_ref.model.path`` resolves to. Ctrl-C or SIGTERM stops with one line (exit 130/143).
        """
        agent = _as_agent(agent)
        train = _check_dataset(train_dataset, "train_dataset")
        val = _check_dataset(val_dataset, "val_dataset") if val_dataset is not None else None
        self._reward = _check_reward(reward)
        bs = self.config.data.train_batch_size
        if len(train) < bs:
            raise ValueError(f"train_dataset has {len(train)} tasks, fewer than data.train_batch_size ({bs})")
        _quiet_defaults(self.config)
        cfg = self.config
        dump = cfg.model_dump(mode="json")
        identity = ck.run_identity(dump, train, val, *([reward.describe()] if reward is not None else []))
        plan = ck.plan_run(cfg.trainer.run_dir, cfg.trainer.resume, identity, dump)
        if plan.action == "finished":
            log.warning("run already finished; returning its result", run_dir=str(plan.run_dir))
            return _finished_result(plan)
        created = not plan.run_dir.exists()
        where = {"run_dir": str(plan.run_dir)}
        if plan.action == "resume":
            where["resume_from_step"] = str(plan.step)
        if plan.note:
            where["why"] = plan.note
        log.warning("writing run", **where)  # once per fit: where the outputs go
        state = FitState(plan=plan, identity=identity)
        try:
            with clean_stop(state):
                try:
                    # uvloop where installed: the proxy it hosts spends less CPU per call
                    return event_loop.run(self._fit, agent, train, val, store, engine, state)
                except BaseExceptionGroup as group:  # the loop's task group: raise the one error itself
                    leaf = single_error(group)
                    if leaf is None:
                        raise
                    raise leaf from None
        except BaseException:
            if not state.started and created:  # a failed start leaves no folder behind
                shutil.rmtree(plan.run_dir, ignore_errors=True)
            raise

    # ------------------------------------------------------------ the loop

    async def _fit(
        self,
        agent: Agent,
        train: list[Any],
        val: list[Any] | None,
        store: Store | None,
        engine: Any,
        state: FitState,
    ) -> FitResult:
        """The run inside a cancel scope that a SIGINT/SIGTERM cancels (cleanup runs shielded)."""
        import asyncio

        with anyio.CancelScope() as scope:
            state.loop, state.scope = asyncio.get_running_loop(), scope
            return await self._run(agent, train, val, store, engine, state)
        raise Stopped  # only a signal cancels the scope

    async def _run(
        self,
        agent: Agent,
        train: list[Any],
        val: list[Any] | None,
        store: Store | None,
        engine: Any,
        state: FitState,
    ) -> FitResult:
        from agentloop.engine.factory import load_engine
        from agentloop.engine.models import resolve_model
        from agentloop.store.sqlite import SQLiteStore

        cfg = self.config
        limits = cfg.trainer.timeouts
        plan = state.plan
        run_dir = plan.run_dir
        model_path = resolve_model(
            cfg.actor_rollout_ref.model.path
        )  # before the folder: a bad path leaves none
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        self._judge = self._reward.for_run(run_dir / "judge.jsonl") if self._reward is not None else None
        record: dict[str, Any] = {"identity": state.identity, "status": "running", "step": plan.step}
        ck.write_run(run_dir, record)
        device = str(resolve_device(cfg.trainer.device))
        own_store = store is None
        store = store or SQLiteStore(run_dir / "store.db")
        layout = place(cfg, str(model_path), device, engine_given=engine is not None)  # ranks, replicas
        if engine is None and layout.engine is None:
            kwargs = engine_kwargs(cfg.actor_rollout_ref.rollout)
            engine = await deadline(
                anyio.to_thread.run_sync(
                    lambda: load_engine(str(model_path), device=device, **kwargs), abandon_on_cancel=True
                ),
                limits.engine_s,
                f"the inference engine to load {model_path}",
                "engine_s",
            )
        engine = engine or layout.engine
        worker = layout.worker or _start_worker(cfg, str(model_path), device)
        if state.handler is not None:  # ray.init replaced our SIGTERM handler with its sys.exit(15)
            signal.signal(signal.SIGTERM, state.handler)
        if hasattr(worker, "ready"):
            await deadline(
                worker.ready.remote(), limits.engine_s, f"the trainer worker to load {model_path}", "engine_s"
            )
        ckpt = CheckpointManager(run_dir / "checkpoints")
        cursor = DataCursor(len(train), cfg.data.train_batch_size, cfg.trainer.seed)
        total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * cursor.batches_per_epoch
        record["total_steps"] = total_steps
        if plan.action == "resume":
            dropped = ck.keep_metrics_until(run_dir / "metrics.jsonl", plan.step)
            log.warning(
                "resuming",
                step=plan.step,
                checkpoint=str(plan.checkpoint[0]) if plan.checkpoint else None,
                metrics_lines_dropped=dropped,
            )
        metrics_log = MetricsLogger.create(
            cfg.trainer.logger,
            run_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            cfg.model_dump(mode="json"),  # keys (SecretStr) as ********** for W&B
        )
        result = FitResult(
            run_dir=run_dir, steps=0, resumed_from=plan.step if plan.action == "resume" else None
        )
        proxy = training_proxy(cfg, engine, store, record_sessions=self._judge is None)
        store_server = await serve_store(cfg, store)  # None unless placement.store_server (remote runners)
        try:
            await deadline(proxy.start(), limits.engine_s, "the proxy to start", "engine_s")
            self._served = (_served_llm(proxy), engine)
            step = await self._resume(ckpt, worker, engine, cursor, store, plan)
            rollout_cfg = cfg.actor_rollout_ref.rollout
            sampling = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p}
            sampling["max_tokens"] = cfg.data.max_response_length
            resources = Resources(items={LLM_RESOURCE: proxy.as_resource("agentloop", sampling)})
            val_sampling = {**rollout_cfg.val_kwargs.sampling(), "max_tokens": cfg.data.max_response_length}
            val_resources = Resources(
                items={LLM_RESOURCE: proxy.as_resource("agentloop", val_sampling, enforce_sampling=True)}
            )
            await store.add_resources(resources)
            runner = Runner(agent, store, concurrency=rollout_cfg.concurrency)
            runner_done = anyio.Event()

            async def run_runner() -> None:
                try:
                    await runner.run()
                finally:
                    runner_done.set()

            state.started = True
            async with anyio.create_task_group() as tg:
                if cfg.placement.local_runner:
                    tg.start_soon(run_runner)
                else:
                    runner_done.set()
                validate = functools.partial(
                    self._validate, store, val or [], metrics_log, resources, val_resources
                )
                if val and cfg.trainer.val_before_train and step == 0:
                    result.val_history.append(await validate(step))
                pending: deque[_Pending] = deque()
                progress = _progress(total_steps, step)
                started = time.perf_counter()
                state.step = step
                while step < total_steps:
                    while len(pending) <= rollout_cfg.max_staleness and (step + len(pending) < total_steps):
                        pending.append(await self._enqueue(store, train, cursor, step + len(pending)))
                    batch_info = pending.popleft()
                    metrics = await self._train_step(store, worker, engine, resources, batch_info, cfg)
                    step += 1
                    state.step = step
                    metrics["step"] = step
                    metrics["timing/elapsed_s"] = time.perf_counter() - started  # since this fit's loop began
                    last = step == total_steps
                    if val and (last or (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0)):
                        if last:  # async mode: batches for steps that will not run
                            for p in pending:
                                for rid in p.rollout_ids:
                                    await cancel_quietly(store, rid)
                            pending.clear()
                        for p in pending:  # in flight on the training weights: let them finish first
                            await wait_all(store, p.rollout_ids, limits.rollouts_s, f"step {p.step + 1}")
                        val_metrics = await validate(step)
                        result.val_history.append(val_metrics)
                        metrics.update(val_metrics)
                    metrics_log.log(step, metrics)
                    result.history.append(metrics)
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
                    if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or last):
                        # async mode has batches enqueued but not trained: resume re-draws them
                        data_state = pending[0].cursor_before if pending else cursor.state()
                        await self._checkpoint(ckpt, worker, step, data_state)
                        record["step"] = step
                        ck.write_run(run_dir, record)
                progress.close()
                for p in pending:  # async mode may have enqueued beyond the last step
                    for rid in p.rollout_ids:
                        await cancel_quietly(store, rid)
                runner.stop()
                with anyio.move_on_after(limits.runner_s):
                    await runner_done.wait()
                if not runner_done.is_set():
                    raise TrainerTimeoutError(
                        f"gave up waiting {limits.runner_s:g} s for the local runner to stop (an agent that "
                        "ignores cancellation?); raise trainer.timeouts.runner_s if it is only slow"
                    )
            result.steps = step
            model_dir, adapter_dir = await self._save_model(worker, str(model_path), run_dir)
            result.model_dir, result.adapter_dir = model_dir, adapter_dir
        finally:
            metrics_log.close()
            with anyio.move_on_after(60, shield=True):  # also when a signal cancelled the run
                await proxy.stop()
                if store_server is not None:
                    await store_server.stop()
                if self._weight_sync is not None:
                    await self._weight_sync.close()
                    self._weight_sync = None
                self._local_sync = None
                await layout.aclose()
                if own_store:
                    await store.close()
        if (run_dir / "metrics.jsonl").exists():
            plot_curves(
                run_dir / "metrics.jsonl",
                run_dir / "reward_curve.png",
                keys=("reward/mean", "val/reward_mean"),
            )
        result.metrics = _final_metrics(result.history, result.val_history)
        record.update(
            status="finished",
            step=result.steps,
            model_dir=ck.FINAL_MODEL,
            adapter_dir=ck.FINAL_ADAPTER if adapter_dir is not None else None,
            metrics=result.metrics,
        )
        ck.write_run(run_dir, record)
        log.info("run finished", run_dir=str(run_dir), steps=result.steps, model_dir=str(model_dir))
        return result

    async def _save_model(self, worker: Any, model_path: str, run_dir: Path) -> tuple[Path, Path | None]:
        """``final_model/`` (and ``final_adapter/`` for LoRA) from the trained weights."""
        limits = self.config.trainer.timeouts
        model_dir = run_dir / ck.FINAL_MODEL
        lora = self.config.actor_rollout_ref.model.lora_rank > 0
        adapter_dir = run_dir / ck.FINAL_ADAPTER if lora else None
        call = worker.save_model.remote(model_path, str(model_dir), str(adapter_dir) if adapter_dir else None)
        await deadline(call, limits.save_s, f"the final model to be written to {model_dir}", "save_s")
        return model_dir, adapter_dir

    async def _enqueue(self, store: Store, train: list[Any], cursor: DataCursor, step: int) -> _Pending:
        n = self.config.actor_rollout_ref.rollout.n
        ids = []
        config = rollout_config(self.config)
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
        limits = cfg.trainer.timeouts
        t_wait = time.perf_counter()
        finished = await wait_all(store, pending.rollout_ids, limits.rollouts_s, f"step {pending.step + 1}")
        rollout_s = time.perf_counter() - pending.enqueued_at
        wait_s = time.perf_counter() - t_wait
        judged = await self._judge_rollouts(store, pending.rollout_ids)  # Reward spans, before the triplets
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
            **judged,
        }
        metrics.update(_attempt_metrics(triplets))
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
            log.warning(
                "rollouts failed", step=pending.step + 1, failed=failed, of=len(finished), errors=errors
            )
        if len(batch) == 0:
            log.warning(
                "trainer.empty_batch", step=pending.step + 1, **{k: v for k, v in batch_stats.items() if v}
            )
            if not triplets:
                n = len(pending.rollout_ids)
                if failed == n:
                    why = f"all {n} rollouts failed; their attempts' errors: {errors}"
                elif failed:
                    why = (
                        f"{failed} of {n} rollouts failed ({errors}); the rest made no LLM call through "
                        "llm.base_url"
                    )
                else:
                    why = f"none of the {n} rollouts made an LLM call through llm.base_url (the proxy records the tokens)"
                raise EmptyBatchError(f"step {pending.step + 1}: no training samples: {why}")
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
            self._sync_weights(worker, engine),
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

    async def _judge_rollouts(self, store: Store, rollout_ids: list[str]) -> dict[str, float]:
        """fit(reward=judge): the judge scores each task's succeeded attempts and the scores become Reward
        spans (the triplets are built from them); its own llm, else the served model (its weights version
        joins the cache key). A JudgeError stops the run, unless the judge has on_failure='skip'."""
        if self._judge is None:
            return {}
        llm, engine = self._served
        version = None if self._judge.llm is not None else getattr(engine, "weights_version", None)
        return dict(await self._judge.judge_rollouts(store, rollout_ids, llm=llm, version=version))

    async def _sync_weights(self, worker: Any, engine: Any) -> tuple[int, dict[str, float]]:
        """New weights into the engine: data-parallel ranks straight into a replica pool (CUDA IPC /
        NCCL, trainer/weight_sync.py), a worker on the engine's GPU by CUDA IPC (trainer/local_sync.py),
        else through the driver (``engine.update_weights``)."""
        if weight_sync.supports(worker, engine):
            if self._weight_sync is None:
                self._weight_sync = weight_sync.WeightSync(worker, engine)
            report = await self._weight_sync.sync()
            return report.version, report.metrics()
        if self._local_sync is None:  # decided once per run: False when worker and engine share no GPU
            self._local_sync = await local_sync.LocalIPCSync.create(worker, engine) or False
        if isinstance(self._local_sync, local_sync.LocalIPCSync):
            report = await self._local_sync.sync()
            return report.version, report.metrics()
        return int(await engine.update_weights(await worker.named_weights.remote())), {}

    async def _validate(
        self,
        store: Store,
        val: list[Any],
        metrics_log: MetricsLogger,
        resources: Resources,
        val_resources: Resources,
        step: int,
    ) -> dict[str, float]:
        """Every validation task ``val_kwargs.n`` times with the validation sampling (greedy by default):
        its resources are published for the run and the training ones restored afterwards. Only
        validation rollouts run meanwhile (the loop lets in-flight training rollouts finish first)."""
        t0 = time.perf_counter()
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        await store.add_resources(Resources(items=val_resources.items))
        try:
            ids = [
                (
                    await store.enqueue_rollout(
                        task,
                        "val",
                        config=rollout_config(self.config),
                        metadata={"step": step, "sample_index": i},
                    )
                ).rollout_id
                for task in val
                for i in range(n)
            ]
            finished = await wait_all(
                store, ids, self.config.trainer.timeouts.rollouts_s, f"validation at step {step}"
            )
        finally:
            await store.add_resources(Resources(items=resources.items))
        judged = await self._judge_rollouts(store, ids)
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

    # ------------------------------------------------------------ checkpoints

    async def _checkpoint(
        self, ckpt: CheckpointManager, worker: Any, step: int, data_state: dict[str, int]
    ) -> None:
        path = ckpt.begin(step)
        limit = self.config.trainer.timeouts.save_s
        call = worker.save_checkpoint.remote(str(path))  # safetensors weights beside the optimizer state
        await deadline(call, limit, f"checkpoint {path} to be written", "save_s")
        ckpt.commit(step, {"step": step, "cursor": data_state})

    async def _resume(
        self,
        ckpt: CheckpointManager,
        worker: Any,
        engine: Any,
        cursor: DataCursor,
        store: Store,
        plan: RunPlan,
    ) -> int:
        # Rollouts a killed run left queued or running are cancelled: the resumed run re-enqueues its batch.
        stale = await store.list_rollouts(status=["queued", "requeued", "running"])
        for rollout in stale:
            await cancel_quietly(store, rollout.rollout_id)
        if plan.checkpoint is None:
            return 0
        path, state = plan.checkpoint
        limits = self.config.trainer.timeouts
        call = worker.load_checkpoint.remote(str(path))
        await deadline(call, limits.engine_s, f"checkpoint {path} to load", "engine_s")
        await deadline(
            self._sync_weights(worker, engine),
            limits.weight_sync_s,
            "the checkpoint's weights to reach the engine",
            "weight_sync_s",
        )
        cursor.load_state(state["cursor"])
        log.warning("resumed", step=state["step"], checkpoint=str(path), cancelled_stale_rollouts=len(stale))
        return int(state["step"])


# ---------------------------------------------------------------- helpers


def _start_worker(config: TrainerConfig, model_path: str, device: str) -> Any:
    import ray

    init_ray(config)
    gpus = 1 if device.startswith("cuda") else 0
    remote_cls = ray.remote(num_cpus=0, num_gpus=gpus)(TrainerWorker)
    return remote_cls.remote(config, model_path, device)


def rollout_config(config: TrainerConfig) -> RolloutConfig:
    """What every training and validation rollout gets: an attempt that runs over
    ``rollout.agent_timeout_s`` is cancelled (status timeout) and retried once; a runner that goes
    silent for 300 s leaves its attempt to the unresponsive watchdog."""
    return RolloutConfig(
        max_attempts=2, unresponsive_s=300.0, timeout_s=config.actor_rollout_ref.rollout.agent_timeout_s
    )


def _attempt_metrics(triplets: list[Triplet]) -> dict[str, float]:
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


def _check_reward(reward: Any) -> Any:
    from agentloop.judge import RewardJudge

    if reward is not None and not isinstance(reward, RewardJudge):
        raise TypeError(
            f"reward must be al.judge_reward(...) (a RewardJudge) or None, got {type(reward).__name__}; "
            "a reward the agent computes itself is returned by the agent"
        )
    return reward


def training_proxy(cfg: TrainerConfig, engine: Any, store: Store, record_sessions: bool) -> Proxy:
    """The proxy a fit serves its agents through (not started)."""
    from secrets import token_urlsafe

    from agentloop.proxy import Proxy

    return Proxy(
        engine,
        store,
        host=cfg.placement.proxy_host,
        advertise_host=cfg.placement.proxy_advertise_host,
        # a key per run: agents get it as llm.api_key (ProxyLLM.api_key, remote runners through the
        # store's resources); no one else who can reach the port gets generations
        api_key=token_urlsafe(32),
        max_body_bytes=32 * 1024 * 1024,
        default_max_tokens=cfg.data.max_response_length,
        record_sessions=record_sessions,  # False with a judge: its calls (session route) are no app sessions
        workers=cfg.actor_rollout_ref.rollout.proxy_workers,
    )


def _served_llm(proxy: Any) -> Any:
    """The served model on the proxy's session route (recorded as no rollout): what a judge without
    its own llm calls."""
    from agentloop.resources import LLM

    return LLM(base_url=proxy.session_base_url, model=proxy.model_name, api_key=proxy.as_resource().api_key)


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


def _quiet_defaults(config: TrainerConfig) -> None:
    """A quiet console unless the user configured otherwise: agentloop's logging at INFO (per-rollout
    lines are debug) and no token-auth notice from a local Ray (its mode is set explicitly, as Ray's
    own default: token)."""
    from agentloop import logging as al_logging

    if getattr(al_logging, "_configured", None) is None:
        al_logging.configure_logging()
    if config.trainer.ray_address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _finished_result(plan: RunPlan) -> FitResult:
    """The result of a run that finished before, read from its folder."""
    record = plan.record or {}
    rows = read_metrics(plan.run_dir / "metrics.jsonl")
    history = [r for r in rows if r.get("step", 0) >= 1]
    val_history = [
        {k: v for k, v in r.items() if k.startswith("val/") or k == "timing/val_s"}
        for r in rows
        if "val/reward_mean" in r
    ]
    adapter = record.get("adapter_dir")
    return FitResult(
        run_dir=plan.run_dir,
        steps=int(record.get("step", 0)),
        history=history,
        val_history=val_history,
        model_dir=plan.run_dir / record.get("model_dir", ck.FINAL_MODEL),
        adapter_dir=plan.run_dir / adapter if adapter else None,
        metrics=dict(record.get("metrics") or {}),
        already_finished=True,
    )


def _final_metrics(history: list[dict[str, float]], val_history: list[dict[str, float]]) -> dict[str, float]:
    out = dict(history[-1]) if history else {}
    if val_history:
        out.update(val_history[-1])
    return out


def _progress(total: int, initial: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True)


__all__ = ["FitResult", "Trainer", "TrainerWorker", "failure_summary"]
