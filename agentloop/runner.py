"""Runner: dequeue rollouts, run up to N agents at once, heartbeat, enforce timeouts, report.

One attempt, as the runner sees it::

    dequeue ─► update_attempt(running) ─► agent.rollout(task, resources, rollout)   (heartbeats meanwhile)
                                              │ returns a reward / None   ─► Reward span, succeeded
                                              │ raises                    ─► failed (+ traceback)
                                              │ runs over timeout_s       ─► cancelled, timeout
                                              └ runner stopped (stop(), SIGINT/SIGTERM) ─► cancelled, failed

A failed or timed-out attempt is retried by the store per ``RolloutConfig.retry_on``. When the
store has already ended the attempt (watchdog, cancel_rollout), the runner's report is refused and
logged; nothing else happens.

Traps: a sync agent runs in a worker thread and cannot be interrupted; on timeout or stop it is
abandoned (the thread finishes on its own, its later writes are refused).
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import TaskStatus

from agentloop import event_loop, tracing
from agentloop.agent import Agent, FunctionAgent, attempt_context, check_reward
from agentloop.agent_errors import fold_traceback, user_location
from agentloop.errors import InvalidTransitionError, StoreUnavailableError
from agentloop.logging import get_logger
from agentloop.store.base import Store
from agentloop.types import AttemptedRollout, AttemptStatus, ErrorInfo, Reward, Span


class _Log:
    """``get_logger("agentloop.runner")`` on each call: a logger bound at import would keep the
    structlog configuration of import time and ignore a later ``configure_logging`` (levels, stream)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(get_logger("agentloop.runner"), name)


log = _Log()

__all__ = ["Runner", "RunnerStats"]

_MAX_HEARTBEAT_S = 10.0  # heartbeat at least this often, also when unresponsive_s is unset
_REPORT_TIMEOUT_S = 30.0  # a final status write that takes longer is given up (the watchdog takes over)


@dataclass
class RunnerStats:
    """What one ``Runner.run`` did, by attempt outcome."""

    attempts: int = 0  # dequeued attempts
    succeeded: int = 0
    failed: int = 0  # the agent raised or broke its contract
    timeout: int = 0  # cancelled after timeout_s (by the runner, or by the store's watchdog first)
    stopped: int = 0  # cancelled because the runner stopped (reported as failed)
    lost: int = 0  # the store had already ended the attempt otherwise (cancel) or was unreachable


@dataclass
class _Outcome:
    status: AttemptStatus
    error: ErrorInfo | None = None
    reward: float | None = None
    kind: str = "succeeded"  # the RunnerStats field to count it in


def _error_info(exc: BaseException) -> ErrorInfo:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorInfo(type=type(exc).__qualname__, message=str(exc), traceback=tb)


def _as_agent(agent: Any) -> Agent:
    if isinstance(agent, Agent):
        return agent
    if isinstance(agent, type) and issubclass(agent, Agent):
        raise TypeError(
            f"Runner expects an agent instance; got the class {agent.__qualname__}, call it first"
        )
    if callable(agent):
        return FunctionAgent(agent)  # a plain function, as if decorated with @rollout
    raise TypeError(f"Runner expects an al.Agent or an @al.rollout function, got {type(agent).__name__}")


class Runner:
    """Pull rollouts from ``store`` and run ``agent`` on them, up to ``concurrency`` at once."""

    def __init__(
        self,
        agent: Agent | Callable[..., Any],
        store: Store,
        concurrency: int = 1,
        worker_id: str | None = None,
        poll_interval: float = 0.05,
        heartbeat_interval: float | None = None,
    ) -> None:
        self.agent = _as_agent(agent)
        if not isinstance(store, Store):
            raise TypeError(
                f"Runner expects a Store (MemoryStore, SQLiteStore, StoreClient), got {type(store).__name__}"
            )
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        for field, value in (("poll_interval", poll_interval), ("heartbeat_interval", heartbeat_interval)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"{field} must be a number of seconds > 0, got {value!r}")
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
            raise ValueError(f"worker_id must be a non-empty string or None, got {worker_id!r}")
        self.store = store
        self.concurrency = concurrency
        self.worker_id = worker_id or f"runner-{uuid.uuid4().hex[:12]}"
        self.poll_interval = float(poll_interval)
        self.heartbeat_interval = heartbeat_interval
        self._running = False
        self._stopping = False
        self._cancel_running = False
        self._stop_event: anyio.Event | None = None
        self._stop_pending = False  # stop() came before run() started: the next run() returns at once
        self._loop_thread = 0
        self._loop_token: Any = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._thread_limiter: anyio.CapacityLimiter | None = None
        self._errors_seen: set[tuple[str, str]] = set()  # (type, first line): warned once per run
        self.stats = RunnerStats()
        self.stop_signal: int | None = None  # the SIGINT/SIGTERM that stopped the last run, if one did

    # ------------------------------------------------------------ control

    @property
    def running(self) -> bool:
        return self._running

    def stop(self, cancel_running: bool = True) -> None:
        """Stop taking rollouts. With ``cancel_running`` (default) in-flight attempts are cancelled and
        reported failed ("runner stopped", so the store requeues them per retry_on); otherwise they finish.
        Safe to call from any thread. Called before ``run`` has started (a task scheduled with
        ``start_soon`` that has not run yet), the stop is kept: the next ``run`` returns at once."""
        if not self._running:
            self._stop_pending = True
            return
        if threading.get_ident() != self._loop_thread:
            anyio.from_thread.run_sync(self._stop, cancel_running, token=self._loop_token)
        else:
            self._stop(cancel_running)

    def _stop(self, cancel_running: bool) -> None:
        if not self._stopping:
            log.info("runner_stopping", worker_id=self.worker_id, cancel_running=cancel_running)
        self._stopping = True
        if cancel_running:
            self._cancel_running = True
            for scope in self._scopes.values():
                scope.cancel()
        if self._stop_event is not None:
            self._stop_event.set()

    # ------------------------------------------------------------ main loop

    async def run(self, max_rollouts: int | None = None, handle_signals: bool = False) -> RunnerStats:
        """Run until ``max_rollouts`` attempts have finished (None: until stopped) and return the stats.

        ``handle_signals``: on SIGINT/SIGTERM stop cleanly (main thread only).
        """
        if max_rollouts is not None and (isinstance(max_rollouts, bool) or not isinstance(max_rollouts, int)):
            raise TypeError(f"max_rollouts must be an int or None, got {type(max_rollouts).__name__}")
        if max_rollouts is not None and max_rollouts < 0:
            raise ValueError(f"max_rollouts must be >= 0, got {max_rollouts}")
        if handle_signals and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Runner.run(handle_signals=True) must run in the main thread (signal handlers)"
            )
        if self._running:
            raise RuntimeError(f"runner {self.worker_id} is already running; one run() at a time")
        if self._stop_pending:  # stopped before it started: nothing to do (the stop is used up)
            self._stop_pending = False
            self.stats = RunnerStats()
            log.debug("runner_stopped_before_start", worker_id=self.worker_id)
            return self.stats
        self._stopping, self._cancel_running, self.stop_signal = False, False, None
        self._stop_event = anyio.Event()
        self._loop_thread = threading.get_ident()
        self._loop_token = anyio.lowlevel.current_token()
        self._running = True  # last: a stop() from another thread now finds the loop token set
        self._thread_limiter = anyio.CapacityLimiter(self.concurrency)  # worker threads of sync agents
        self.stats = RunnerStats()
        self._errors_seen = set()
        log.info(
            "runner_started",
            worker_id=self.worker_id,
            concurrency=self.concurrency,
            max_rollouts=max_rollouts,
        )
        try:
            async with anyio.create_task_group() as outer:
                if handle_signals:
                    await outer.start(self._watch_signals)
                await self._loop(max_rollouts)
                outer.cancel_scope.cancel()  # ends the signal watcher
        finally:
            self._running = False
            log.info("runner_stopped", worker_id=self.worker_id, **vars(self.stats))
        return self.stats

    def run_sync(self, max_rollouts: int | None = None, handle_signals: bool = True) -> RunnerStats:
        """``run`` in a new event loop (uvloop where installed, see agentloop.event_loop); handles
        SIGINT/SIGTERM when called from the main thread."""
        handle = handle_signals and threading.current_thread() is threading.main_thread()
        return event_loop.run(functools.partial(self.run, max_rollouts=max_rollouts, handle_signals=handle))

    async def _loop(self, max_rollouts: int | None) -> None:
        assert self._stop_event is not None
        slots = anyio.Semaphore(self.concurrency)
        dequeued = 0
        async with anyio.create_task_group() as attempts:
            while not self._stopping and (max_rollouts is None or dequeued < max_rollouts):
                await slots.acquire()  # a free slot: an in-flight attempt finished (or was cancelled)
                if self._stopping:
                    slots.release()
                    break
                try:
                    rollout = await self.store.dequeue_rollout(self.worker_id)
                except (StoreUnavailableError, OSError) as exc:
                    log.warning("dequeue_failed", worker_id=self.worker_id, error=repr(exc))
                    rollout = None
                if rollout is None:
                    slots.release()
                    with anyio.move_on_after(self.poll_interval):
                        await self._stop_event.wait()
                    continue
                dequeued += 1
                self.stats.attempts += 1
                attempts.start_soon(
                    self._run_attempt, rollout, slots, name=f"attempt {rollout.attempt.attempt_id}"
                )

    async def _watch_signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                log.warning("runner_signal", worker_id=self.worker_id, signal=signal.Signals(signum).name)
                self.stop_signal = int(signum)
                self._stop(cancel_running=True)

    # ------------------------------------------------------------ one attempt

    async def _run_attempt(self, rollout: AttemptedRollout, slots: anyio.Semaphore) -> None:
        aid = rollout.attempt.attempt_id
        scope = anyio.CancelScope()
        self._scopes[aid] = scope
        if self._cancel_running:
            scope.cancel()
        stopped = _Outcome(
            AttemptStatus.FAILED,
            ErrorInfo(
                type="RunnerStopped", message=f"runner {self.worker_id} stopped while the attempt was running"
            ),
            kind="stopped",
        )
        start = time.monotonic()
        log.debug(  # per-rollout lines are debug: thousands of rollouts must not flood the console
            "attempt_started", rollout_id=rollout.rollout_id, attempt_id=aid, seq=rollout.attempt.sequence_id
        )
        try:
            outcome: _Outcome | None = None
            with scope:
                outcome = await self._execute(rollout)
            await self._report(rollout, outcome or stopped, time.monotonic() - start)
        except anyio.get_cancelled_exc_class():  # cancelled from outside (e.g. the event loop shut down)
            await self._report(rollout, stopped, time.monotonic() - start)
            raise
        finally:
            self._scopes.pop(aid, None)
            slots.release()
        # off by default: returns at once; on, it reads the finished rollout back for its trace
        name = getattr(self.agent, "name", None) or type(self.agent).__name__
        await tracing.export_rollout(self.store, rollout.rollout_id, attempt_id=aid, agent_name=name)

    async def _execute(self, rollout: AttemptedRollout) -> _Outcome | None:
        """Run the agent; an _Outcome to report, or None when the store ended the attempt first."""
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            await self.store.update_attempt(rid, aid, status=AttemptStatus.RUNNING)
        except InvalidTransitionError as exc:  # cancelled or timed out before we started
            log.warning("attempt_gone", rollout_id=rid, attempt_id=aid, error=str(exc))
            return _Outcome(AttemptStatus.FAILED, _error_info(exc), kind="lost")
        except Exception as exc:  # the store is unreachable: leave the attempt to its watchdog
            log.error("attempt_start_failed", rollout_id=rid, attempt_id=aid, error=repr(exc))
            return _Outcome(AttemptStatus.FAILED, _error_info(exc), kind="lost")
        timeout = rollout.config.timeout_s
        lost: list[BaseException] = []  # set by the heartbeat when the store refuses this attempt
        reward: float | None = None
        error: BaseException | None = None
        timed_out = False
        try:
            async with attempt_context(rollout, self.store, thread_limiter=self._thread_limiter) as ctx:
                async with anyio.create_task_group() as tg:
                    agent_scope = anyio.move_on_after(math.inf if timeout is None else timeout)
                    tg.start_soon(self._heartbeat, rollout, agent_scope, lost)
                    try:
                        with agent_scope:
                            value = await self.agent.rollout(rollout.input, rollout.resources, rollout)
                            reward = check_reward(value, self.agent)
                    except Exception as exc:
                        error = exc
                    finally:
                        tg.cancel_scope.cancel()  # ends the heartbeat
                timed_out = agent_scope.cancelled_caught and not lost
                if error is None and not timed_out and not lost and reward is not None:
                    final = Span(rollout_id=rid, attempt_id=aid, payload=Reward(value=reward, name="final"))
                    await ctx.submit_span(final)
        except Exception as exc:  # span writes refused, or the context failed
            error = error or exc
        if lost:
            return _Outcome(AttemptStatus.FAILED, _error_info(lost[0]), kind="lost")
        if timed_out:
            err = ErrorInfo(
                type="Timeout", message=f"the agent ran over timeout_s={timeout} and was cancelled"
            )
            return _Outcome(AttemptStatus.TIMEOUT, err, kind="timeout")
        if error is not None:
            return _Outcome(AttemptStatus.FAILED, _error_info(error), kind="failed")
        return _Outcome(AttemptStatus.SUCCEEDED, reward=reward)

    async def _heartbeat(
        self, rollout: AttemptedRollout, agent_scope: anyio.CancelScope, lost: list[Any]
    ) -> None:
        unresponsive = rollout.config.unresponsive_s
        interval = self.heartbeat_interval or min(
            _MAX_HEARTBEAT_S, unresponsive / 3 if unresponsive else math.inf
        )
        while True:
            await anyio.sleep(interval)
            try:
                await self.store.update_attempt(
                    rollout.rollout_id, rollout.attempt.attempt_id, heartbeat=True
                )
            except InvalidTransitionError as exc:  # the store ended this attempt: stop working on it
                log.warning("attempt_ended_by_store", rollout_id=rollout.rollout_id, error=str(exc))
                lost.append(exc)
                agent_scope.cancel()
                return
            except Exception as exc:  # a missed heartbeat is not fatal; the next one may get through
                log.warning("heartbeat_failed", rollout_id=rollout.rollout_id, error=repr(exc))

    async def _report(self, rollout: AttemptedRollout, outcome: _Outcome, duration_s: float) -> None:
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        kind = outcome.kind
        if kind != "lost":
            with anyio.CancelScope(shield=True), anyio.move_on_after(_REPORT_TIMEOUT_S):
                try:
                    await self.store.update_attempt(rid, aid, status=outcome.status, error=outcome.error)
                except InvalidTransitionError as exc:
                    log.warning("attempt_report_refused", rollout_id=rid, attempt_id=aid, error=str(exc))
                    kind = "lost"
                except Exception as exc:
                    log.error("attempt_report_failed", rollout_id=rid, attempt_id=aid, error=repr(exc))
                    kind = "lost"
        if kind == "lost":
            kind = await self._ended_by_store_as(rid, aid)
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        error = outcome.error
        if error is not None and outcome.status is not AttemptStatus.SUCCEEDED and kind != "stopped":
            key = (error.type, error.message.splitlines()[0] if error.message else "")
            if key not in self._errors_seen:  # the store keeps every attempt's error; counts: the trainer
                self._errors_seen.add(key)
                self._first_failure(rid, aid, error)
        log.debug(  # no spam at 1000s/s: a failure's first occurrence is a warning (above)
            "attempt_finished",
            rollout_id=rid,
            attempt_id=aid,
            status=outcome.status.value,
            outcome=kind,
            reward=outcome.reward,
            duration_s=round(duration_s, 4),
            error=outcome.error.message if outcome.error else None,
        )

    async def _ended_by_store_as(self, rollout_id: str, attempt_id: str) -> str:
        """How to count an attempt the store ended itself (our report or heartbeat refused): ``timeout`` when
        its watchdog timed it out, which is what the runner's own timer does a moment later on a loaded
        machine, else ``lost`` (cancelled by the store, or the store unreachable)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REPORT_TIMEOUT_S):
            try:
                attempt = await self.store.get_attempt(rollout_id, attempt_id)
            except Exception:
                return "lost"
            if attempt.status is AttemptStatus.TIMEOUT:
                return "timeout"
        return "lost"

    def _first_failure(self, rollout_id: str, attempt_id: str, error: ErrorInfo) -> None:
        """The first failure of each kind (type, first line) in a run, as a warning with the traceback
        folded to the user's own frames (agentloop.agent_errors); later ones are counted by the trainer
        and listed by ``agentloop inspect RUN --errors``."""
        message = error.message.strip().splitlines()[0] if error.message.strip() else ""
        fields: dict[str, Any] = {"error": f"{error.type}: {message}" if message else error.type}
        where = user_location(error.traceback)
        if where is not None:
            fields["where"] = where
        if error.traceback:
            fields["exception"] = fold_traceback(error.traceback)
        log.warning("attempt_failed", rollout_id=rollout_id, attempt_id=attempt_id, **fields)
