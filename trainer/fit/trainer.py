"""The background training loop: rollouts through the real proxy, updates in a Ray actor, weight sync.

One step (sync mode, ``rollout.max_staleness == 0``)::

    enqueue train_batch_size tasks x rollout.n ─► Runner runs the agent ─► Proxy ─► Engine
    wait_for_rollouts ─► adapter (spans -> triplets) ─► build_batch
    ─► TrainerWorker.update (Ray actor: old/ref logprobs, advantages, PPO/GRPO)
    ─► engine.update_weights(new weights) ; store.add_resources(version + 1)
       (data-parallel ranks + replica pool: straight from the ranks' GPUs, trainer/distributed/weight_sync.py;
        worker and engine on one GPU: CUDA IPC, trainer/distributed/local_sync.py)

A batch with no usable attempt (no reward, the agent raised, ...) trains nothing and is not counted
as a step; ``trainer.max_steps_without_signal`` of them in a row stop the fit (trainer/fit/learning_signal.py).

With ``max_staleness = k > 0`` the next k batches are already enqueued while a batch trains (async
mode); each sample records the weights version it was generated with (``weights_version`` metadata).

Engine, proxy, store and runner live in the driver's event loop; the policy and its optimizer live
in a Ray actor (a GPU of its own when there is one), so the update never blocks the agents' I/O.
The step is trainer/fit/train_step.py, validation trainer/fit/validation.py, the checkpoints through the worker
trainer/fit/worker_checkpoints.py; fit's inputs and result trainer/fit/inputs.py and trainer/fit/result.py.
"""

from __future__ import annotations

import functools
import shutil
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from agentloop import event_loop
from agentloop.agent import Agent
from agentloop.errors import TrainerTimeoutError
from agentloop.logging import run_log
from agentloop.private_files import private_dir, write_private_text
from agentloop.proxy.attempt_keys import PER_ATTEMPT, AttemptKeyStore
from agentloop.resources import ProxyLLM, Resources
from agentloop.runner import Runner, _as_agent
from agentloop.store.base import Store
from trainer.config import TrainerConfig, engine_kwargs
from trainer.distributed import local_sync, weight_sync
from trainer.distributed.placement import init_ray, place, serve_store
from trainer.distributed.worker import TrainerWorker
from trainer.fit.inputs import check_dataset, check_reward, quiet_defaults
from trainer.fit.learning_signal import SignalWatch
from trainer.fit.result import FitResult, final_metrics, finished_result
from trainer.fit.rollout_wait import cancel_quietly, deadline, failure_summary, wait_all
from trainer.fit.stop import FitState, Stopped, clean_stop, single_error
from trainer.fit.train_step import Pending, enqueue_batch, train_step
from trainer.fit.train_step import rollout_config as rollout_config
from trainer.fit.training_proxy import served_llm
from trainer.fit.training_proxy import training_proxy as training_proxy
from trainer.fit.validation import validate as run_validation
from trainer.fit.worker_checkpoints import resume, save_checkpoint, save_model
from trainer.fit.worker_loading import WorkerLoading
from trainer.model.actor import resolve_device
from trainer.run_folder import checkpoint as ck
from trainer.run_folder.changes import input_digests
from trainer.run_folder.checkpoint import CheckpointManager, DataCursor
from trainer.run_folder.metrics import MetricsLogger

log = structlog.get_logger("agentloop.trainer")

LLM_RESOURCE = "main_llm"


def _per_attempt(resource: ProxyLLM) -> ProxyLLM:
    """The resource as stored: no proxy key (AttemptKeyStore puts each attempt's own in at dequeue)."""
    return resource.model_copy(update={"api_key": PER_ATTEMPT})


class Trainer:
    """GRPO/PPO on the triplets your agent's rollouts produce; see TrainerConfig for every key."""

    def __init__(self, config: dict[str, Any] | TrainerConfig | None = None) -> None:
        self.config = TrainerConfig.from_dict(config)
        self._weight_sync: Any = (
            None  # a trainer.distributed.weight_sync.WeightSync while ranks feed a replica pool
        )
        self._local_sync: local_sync.LocalIPCSync | bool | None = None  # one GPU: None until decided
        self._reward: Any = None  # fit(reward=...): an agentloop.judge.RewardJudge
        self._judge: Any = None  # this run's copy of it (verdicts kept in <run folder>/judge.jsonl)
        self._served: Any = None  # (the proxy's session route as an LLM, the engine): a judge without llm
        self._inputs: dict[str, str] = {}  # digests of this fit's data and judge (run.json: what changed)

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
        trainer/run_folder/checkpoint.py: a finished run of this config and data is returned at once, a stopped one
        resumes from its checkpoint, and a folder holding another run is left alone. ``store`` and
        ``engine`` default to a SQLite store in the run folder and the engine that
        ``actor_rollout_ref.model.path`` resolves to. Ctrl-C or SIGTERM stops with one line (exit 130/143).
        """
        agent = _as_agent(agent)
        train = check_dataset(train_dataset, "train_dataset")
        val = check_dataset(val_dataset, "val_dataset") if val_dataset is not None else None
        self._reward = check_reward(reward)
        bs = self.config.data.train_batch_size
        if len(train) < bs:
            raise ValueError(f"train_dataset has {len(train)} tasks, fewer than data.train_batch_size ({bs})")
        quiet_defaults(self.config)
        plan, identity = self._plan(train, val, reward)
        if plan.action == "finished":
            log.warning("run already finished; returning its result", run_dir=str(plan.run_dir))
            return finished_result(plan)
        created = not plan.run_dir.exists()
        where = {"run_dir": str(plan.run_dir)}
        if plan.action == "resume":
            where["resume_from_step"] = str(plan.step)
        if plan.note:
            where["why"] = plan.note
        log.info("writing run", **where)  # once per fit: where the outputs go
        state = FitState(plan=plan, identity=identity)
        try:
            with clean_stop(state), run_log(plan.run_dir / "log.txt"):  # Ray workers, warnings, all events
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

    def plan(
        self,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None = None,
        *,
        reward: Any = None,
        options: dict[str, str] | None = None,
    ) -> ck.RunPlan:
        """What ``fit`` with these inputs would do, without doing it: the folder it would write and
        whether it starts anew, resumes or returns a finished run there (``changed_from`` and ``changes``:
        the folder holding a run of other settings and what differs). A ConfigError when
        ``trainer.on_config_change`` stops the run; ``options`` name its two ways on (the CLI's flags)."""
        train = check_dataset(train_dataset, "train_dataset")
        val = check_dataset(val_dataset, "val_dataset") if val_dataset is not None else None
        return self._plan(train, val, check_reward(reward), options)[0]

    def _plan(
        self, train: list[Any], val: list[Any] | None, reward: Any, options: dict[str, str] | None = None
    ) -> tuple[ck.RunPlan, str]:
        cfg = self.config
        dump = cfg.model_dump(mode="json")
        described = [reward.describe()] if reward is not None else []
        identity = ck.run_identity(dump, train, val, *described)
        self._inputs = input_digests(train, val, described[0] if described else None)
        plan = ck.plan_run(
            cfg.trainer.run_dir,
            cfg.trainer.resume,
            identity,
            dump,
            inputs=self._inputs,
            on_change=cfg.trainer.on_config_change,
            options=options,
        )
        return plan, identity

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
        from agentloop.store.sqlite import SQLiteStore

        t_fit = time.perf_counter()
        cfg = self.config
        limits = cfg.trainer.timeouts
        plan = state.plan
        run_dir = plan.run_dir
        model_path, record = self._open_run_folder(state)
        device = str(resolve_device(cfg.trainer.device))
        own_store = store is None
        store = store or SQLiteStore(run_dir / "store.db")
        layout = place(cfg, str(model_path), device, engine_given=engine is not None)  # ranks, replicas
        if state.handler is not None:  # a ray.init in place() replaced our SIGTERM handler with sys.exit(15)
            signal.signal(signal.SIGTERM, state.handler)
        loading, loaded = await _start_loading(
            cfg, layout, str(model_path), device, load_engine_here=engine is None and layout.engine is None
        )
        worker: Any = None  # the TrainerWorker, from loading.wait() where first needed
        engine = engine or loaded or layout.engine
        _warn_if_policy_differs(engine, cfg.actor_rollout_ref.rollout.weight_update_policy)
        ckpt, cursor, total_steps, metrics_log, result = self._step_state(plan, len(train), record)
        proxy = training_proxy(cfg, engine, store, record_sessions=self._judge is None)
        # runners dequeue through it: each attempt gets its own proxy key (the proxy's is never stored)
        keyed = AttemptKeyStore(store, proxy)
        store_server = await serve_store(cfg, keyed)  # None unless placement.store_server (remote runners)
        try:
            await deadline(proxy.start(), limits.engine_s, "the proxy to start", "engine_s")
            self._served = (served_llm(proxy), engine)
            if plan.checkpoint is not None:
                worker = await loading.wait()
            step = await resume(cfg, ckpt, worker, engine, cursor, store, plan, sync=self._sync_weights)
            resources, val_resources = _rollout_resources(cfg, proxy)
            await store.add_resources(resources)
            steps = _StepLoop(
                cfg=cfg,
                run_dir=run_dir,
                store=store,
                train=train,
                val=val,
                cursor=cursor,
                ckpt=ckpt,
                metrics_log=metrics_log,
                resources=resources,
                val_resources=val_resources,
                result=result,
                record=record,
                state=state,
                loading=loading,
                engine=engine,
                total_steps=total_steps,
            )
            result.steps = await self._steps_beside_the_runner(agent, keyed, steps, step)
            worker = await loading.wait()
            model_dir, adapter_dir = await save_model(cfg, worker, str(model_path), run_dir)
            result.model_dir, result.adapter_dir = model_dir, adapter_dir
        finally:
            loading.close()
            metrics_log.close()
            with anyio.move_on_after(60, shield=True):  # also when a signal cancelled the run
                await self._stop_services(proxy, store_server, layout, store if own_store else None)
        self._finish_run(record, result, t_fit, len(train), len(val) if val else None)
        return result

    def _step_state(
        self, plan: ck.RunPlan, train_size: int, record: dict[str, Any]
    ) -> tuple[CheckpointManager, DataCursor, int, MetricsLogger, FitResult]:
        """The checkpoints, the data cursor, the number of steps (into ``record``), the metric sinks and
        the result the steps fill; a resumed run's metrics.jsonl cut back to its checkpoint."""
        cfg = self.config
        run_dir = plan.run_dir
        ckpt = CheckpointManager(run_dir / "checkpoints")
        cursor = DataCursor(train_size, cfg.data.train_batch_size, cfg.trainer.seed)
        total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * cursor.batches_per_epoch
        record["total_steps"] = total_steps
        if plan.action == "resume":
            _log_resume(plan)
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
        return ckpt, cursor, total_steps, metrics_log, result

    async def _steps_beside_the_runner(
        self, agent: Agent, keyed: AttemptKeyStore, steps: _StepLoop, step: int
    ) -> int:
        """The training steps from ``step``, with the local runner running the agent beside them
        (``placement.local_runner``; remote runners otherwise); the runner stops after the last step.
        Returns the step reached."""
        limits = self.config.trainer.timeouts
        runner = Runner(agent, keyed, concurrency=self.config.actor_rollout_ref.rollout.concurrency)
        runner_done = anyio.Event()

        async def run_runner() -> None:
            try:
                await runner.run()
            finally:
                runner_done.set()

        steps.state.started = True
        async with anyio.create_task_group() as tg:
            if self.config.placement.local_runner:
                tg.start_soon(run_runner)
            else:
                runner_done.set()
            step = await self._train_steps(steps, step)
            runner.stop()
            with anyio.move_on_after(limits.runner_s):
                await runner_done.wait()
            if not runner_done.is_set():
                raise TrainerTimeoutError(
                    f"gave up waiting {limits.runner_s:g} s for the local runner to stop (an agent that "
                    "ignores cancellation?); raise trainer.timeouts.runner_s if it is only slow"
                )
        return step

    def _open_run_folder(self, state: FitState) -> tuple[Any, dict[str, Any]]:
        """The model resolved (before the folder: a bad path leaves none), then the run folder made
        private with its config.json, this run's judge and its record (run.json); returns the model's
        path and the record."""
        from agentloop.engine.models import resolve_model

        cfg = self.config
        plan = state.plan
        run_dir = plan.run_dir
        model_path = resolve_model(cfg.actor_rollout_ref.model.path)
        private_dir(run_dir)  # 0700: the tasks, every rollout, the checkpoints (agentloop.private_files)
        write_private_text(run_dir / "config.json", cfg.model_dump_json(indent=2))
        self._judge = self._reward.for_run(run_dir / "judge.jsonl") if self._reward is not None else None
        record: dict[str, Any] = {
            "identity": state.identity,
            "inputs": self._inputs,
            "status": "running",
            "step": plan.step,
        }
        previous = (ck.read_run(run_dir) or {}) if plan.action == "resume" else {}
        continued = list(previous.get("continued", []))  # each continuation with changes, kept
        if plan.action == "resume" and plan.changes:
            continued.append({"step": plan.step, "changes": [str(c) for c in plan.changes]})
        if continued:
            record["continued"] = continued
        ck.write_run(run_dir, record)
        return model_path, record

    async def _train_steps(self, run: _StepLoop, step: int) -> int:
        """The training steps from ``step`` to the last (validation and checkpoints on their steps);
        returns the step reached. Rollouts enqueued past it are cancelled."""
        cfg, store = run.cfg, run.store
        rollout_cfg = cfg.actor_rollout_ref.rollout
        validate = functools.partial(
            run_validation,
            store,
            run.val or [],
            run.metrics_log,
            run.resources,
            run.val_resources,
            config=cfg,
            judge=self._judge_rollouts,
        )
        if run.val and cfg.trainer.val_before_train and step == 0:
            run.result.val_history.append(await validate(step))
        pending: deque[Pending] = deque()
        signal_watch = SignalWatch(cfg.trainer.max_steps_without_signal, run.run_dir)
        progress = _progress(run.total_steps, step)
        started = time.perf_counter()
        run.state.step = step
        while step < run.total_steps:
            while len(pending) <= rollout_cfg.max_staleness and (step + len(pending) < run.total_steps):
                pending.append(await enqueue_batch(cfg, store, run.train, run.cursor, step + len(pending)))
            batch_info = pending.popleft()
            worker = await run.loading.wait()
            metrics = await train_step(
                store,
                worker,
                run.engine,
                run.resources,
                batch_info,
                cfg,
                judge=self._judge_rollouts,
                sync=self._sync_weights,
            )
            if not signal_watch.observe(metrics, batch_info.rollout_ids):  # trained nothing
                await _step_without_signal(
                    signal_watch, progress, store, step, cfg.trainer.max_steps_without_signal
                )
                continue  # not a training step: the next batch is drawn for the same step
            step += 1
            run.state.step = step
            metrics["step"] = step
            metrics["timing/elapsed_s"] = time.perf_counter() - started  # since this fit's loop began
            last = step == run.total_steps
            if run.val and (last or (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0)):
                await _settle_before_validation(store, pending, last, cfg.trainer.timeouts.rollouts_s)
                val_metrics = await validate(step)
                run.result.val_history.append(val_metrics)
                metrics.update(val_metrics)
            run.metrics_log.log(step, metrics)
            run.result.history.append(metrics)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
            every = cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0
            if every or (last and (cfg.trainer.save_freq > 0 or cfg.trainer.save_last)):
                # async mode has batches enqueued but not trained: resume re-draws them
                data_state = pending[0].cursor_before if pending else run.cursor.state()
                await save_checkpoint(cfg, run.ckpt, worker, step, data_state)
                run.record["step"] = step
                ck.write_run(run.run_dir, run.record)
        progress.close()
        for p in pending:  # async mode may have enqueued beyond the last step
            for rid in p.rollout_ids:
                await cancel_quietly(store, rid)
        return step

    async def _stop_services(
        self, proxy: Any, store_server: Any, layout: Any, own_store: Store | None
    ) -> None:
        """Stop what the run started, in order: the proxy, the store server, weight sync, the placed
        engines and workers, and the store the run opened (``own_store``; None when it was given)."""
        await proxy.stop()
        if store_server is not None:
            await store_server.stop()
        if self._weight_sync is not None:
            await self._weight_sync.close()
            self._weight_sync = None
        self._local_sync = None
        await layout.aclose()
        if own_store is not None:
            await own_store.close()

    def _finish_run(
        self, record: dict[str, Any], result: FitResult, t_fit: float, train_size: int, val_size: int | None
    ) -> None:
        """The report, the final metrics and the finished run record (run.json)."""
        run_dir = result.run_dir
        # report.md, curves.png, summary.json (trainer/run_folder/report.py)
        if (run_dir / "metrics.jsonl").exists():
            _write_report(run_dir, self.config, time.perf_counter() - t_fit, train_size, val_size)
        result.metrics = final_metrics(result.history, result.val_history)
        record.update(
            status="finished",
            step=result.steps,
            model_dir=ck.FINAL_MODEL,
            adapter_dir=ck.FINAL_ADAPTER if result.adapter_dir is not None else None,
            metrics=result.metrics,
        )
        ck.write_run(run_dir, record)
        log.info("run finished", run_dir=str(run_dir), steps=result.steps, model_dir=str(result.model_dir))

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
        NCCL, trainer/distributed/weight_sync.py), a worker on the engine's GPU by CUDA IPC (trainer/distributed/local_sync.py),
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


@dataclass
class _StepLoop:
    """What the training steps of one run work with (``Trainer._train_steps``)."""

    cfg: TrainerConfig
    run_dir: Path
    store: Store
    train: list[Any]
    val: list[Any] | None
    cursor: DataCursor
    ckpt: CheckpointManager
    metrics_log: MetricsLogger
    resources: Resources  # what training rollouts get: the proxy with the training sampling
    val_resources: Resources  # what validation rollouts get: the validation sampling, enforced
    result: FitResult
    record: dict[str, Any]  # run.json, rewritten at each checkpoint
    state: FitState
    loading: WorkerLoading
    engine: Any
    total_steps: int


async def _start_loading(
    cfg: TrainerConfig, layout: Any, model_path: str, device: str, *, load_engine_here: bool
) -> tuple[WorkerLoading, Any]:
    """The inference engine loaded in this process (when ``load_engine_here``) while the trainer worker
    starts loading; returns the worker's loading and the engine loaded here (None when none was)."""
    from agentloop.engine.factory import load_engine

    limits = cfg.trainer.timeouts
    what = f"the trainer worker to load {model_path}"

    def load_worker() -> WorkerLoading:
        """The worker loads while rollouts start: awaited before its first call (trainer/fit/worker_loading.py).
        Unscaled, Ray and the worker start on the Ray thread, leaving this loop free."""
        if layout.worker is not None:
            return WorkerLoading(layout.worker, limits.engine_s, what)
        start = functools.partial(_start_worker, cfg, model_path, device)
        return WorkerLoading.starting(start, limits.engine_s, what)

    # On a GPU, Ray starts and the worker loads its model in its own process while the engine loads here.
    # On a CPU both start once the engine is up: Ray's processes (~7 CPU-s) would slow the engine's load
    # on 2 cores, and the first rollouts need only the engine
    loading = load_worker() if device != "cpu" else None
    engine = None
    try:
        if load_engine_here:
            kwargs = engine_kwargs(cfg.actor_rollout_ref.rollout)
            engine = await deadline(
                anyio.to_thread.run_sync(
                    lambda: load_engine(model_path, device=device, **kwargs), abandon_on_cancel=True
                ),
                limits.engine_s,
                f"the inference engine to load {model_path}",
                "engine_s",
            )
    except BaseException:
        if loading is not None:
            loading.close()
        raise
    return loading or load_worker(), engine


def _log_resume(plan: ck.RunPlan) -> None:
    """A resumed run: metrics.jsonl cut back to the checkpoint's step, and one warning that says so."""
    dropped = ck.keep_metrics_until(plan.run_dir / "metrics.jsonl", plan.step)
    log.warning(
        "resuming",
        step=plan.step,
        checkpoint=str(plan.checkpoint[0]) if plan.checkpoint else None,
        metrics_lines_dropped=dropped,
    )


def _rollout_resources(cfg: TrainerConfig, proxy: Any) -> tuple[Resources, Resources]:
    """The resources training rollouts and validation rollouts get: the proxy as an LLM with each's
    sampling (validation's enforced), no proxy key (each attempt gets its own)."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    sampling = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p}
    sampling["max_tokens"] = cfg.data.max_response_length
    resources = Resources(items={LLM_RESOURCE: _per_attempt(proxy.as_resource("agentloop", sampling))})
    val_sampling = {**rollout_cfg.val_kwargs.sampling(), "max_tokens": cfg.data.max_response_length}
    val_resources = Resources(
        items={
            LLM_RESOURCE: _per_attempt(proxy.as_resource("agentloop", val_sampling, enforce_sampling=True))
        }
    )
    return resources, val_resources


async def _step_without_signal(
    signal_watch: SignalWatch, progress: Any, store: Store, step: int, max_no_signal: int
) -> None:
    """A batch that trained nothing: logged and shown; the fit stops (SignalWatch's error, with why the
    rollouts failed) once ``trainer.max_steps_without_signal`` came in a row."""
    log.warning("trainer.step_without_signal", step=step + 1, **signal_watch.summary())
    progress.set_postfix(reward="nan", no_signal=f"{signal_watch.in_a_row}/{max_no_signal}")
    if signal_watch.exhausted:
        progress.close()
        ids = signal_watch.rollout_ids
        failed = signal_watch.counts["rollout/failed"]
        raise signal_watch.error(await failure_summary(store, ids) if failed else "")


async def _settle_before_validation(
    store: Store, pending: deque[Pending], last: bool, rollouts_s: float
) -> None:
    """Before a validation: after the last step the batches enqueued for steps that will not run are
    cancelled (async mode); the others, in flight on the training weights, finish first."""
    if last:  # async mode: batches for steps that will not run
        for p in pending:
            for rid in p.rollout_ids:
                await cancel_quietly(store, rid)
        pending.clear()
    for p in pending:  # in flight on the training weights: let them finish first
        await wait_all(store, p.rollout_ids, rollouts_s, f"step {p.step + 1}")


def _warn_if_policy_differs(engine: Any, configured: str) -> None:
    """An engine handed to ``fit`` keeps the weight update policy it was built with; the config's
    ``rollout.weight_update_policy`` only reaches engines the trainer builds. Say so when they differ."""
    actual = getattr(engine, "weight_update_policy", None)
    if actual is not None and actual != configured:
        log.warning(
            "engine.weight_update_policy_differs",
            engine=actual,
            config=configured,
            hint="the given engine's policy applies: build it with "
            f"load_engine(..., weight_update_policy={configured!r}) to use the config's",
        )


def _start_worker(config: TrainerConfig, model_path: str, device: str) -> Any:
    import ray

    init_ray(config)
    gpus = 1 if device.startswith("cuda") else 0
    remote_cls = ray.remote(num_cpus=0, num_gpus=gpus)(TrainerWorker)
    return remote_cls.remote(config, model_path, device)


def _progress(total: int, initial: int) -> Any:
    """The one progress bar, on a terminal; piped, the metrics' console sink prints a line per step."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="training",
        unit="step",
        dynamic_ncols=True,
        disable=not sys.stderr.isatty(),
    )


def _write_report(
    run_dir: Any, cfg: TrainerConfig, wall_s: float, train_size: int, val_size: int | None
) -> None:
    """report.md and curves.png as the demo writes them; a finished run does not fail on its report."""
    from trainer.run_folder.report import write_fit_report

    try:
        write_fit_report(
            run_dir, cfg.model_dump(mode="json"), wall_s=wall_s, train_size=train_size, val_size=val_size
        )
    except Exception as exc:  # matplotlib missing or broken, a full disk: the model is saved already
        log.warning("report not written", run_dir=str(run_dir), error=repr(exc))


__all__ = ["FitResult", "Trainer", "TrainerWorker", "failure_summary"]
