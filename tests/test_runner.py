"""Runner: concurrency, timeouts, failures with tracebacks, retries, max_rollouts, stop and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.agent import Agent, rollout
from agentloop.runner import Runner
from agentloop.store.base import Store
from agentloop.store.client import StoreClient
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout, AttemptStatus, RolloutConfig, RolloutStatus

ROOT = Path(__file__).resolve().parent.parent


class _Gauge:
    """Counts agents running right now and the most seen at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


async def _statuses(store: Store, rollout_id: str) -> list[AttemptStatus]:
    return [a.status for a in await store.list_attempts(rollout_id)]


@pytest.mark.anyio  # explicit: the conftest hook marks too late for parametrized tests
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_runs_n_agents_at_once(sync: bool) -> None:
    store, gauge = MemoryStore(), _Gauge()
    if sync:

        @rollout
        def agent(task: dict[str, Any], llm: Any) -> float:
            gauge.enter()
            time.sleep(0.15)
            gauge.leave()
            return 1.0
    else:

        @rollout
        async def agent(task: dict[str, Any], llm: Any) -> float:
            gauge.enter()
            await anyio.sleep(0.15)
            gauge.leave()
            return 1.0

    ids = [(await store.enqueue_rollout({"i": i})).rollout_id for i in range(8)]
    start = time.monotonic()
    with anyio.fail_after(10):
        stats = await Runner(agent, store, concurrency=4).run(max_rollouts=8)
    elapsed = time.monotonic() - start
    assert gauge.peak == 4
    assert stats.attempts == stats.succeeded == 8
    assert elapsed < 8 * 0.15  # ran in parallel, not one after another
    finished = await store.wait_for_rollouts(ids, timeout=0)
    assert {r.status for r in finished} == {RolloutStatus.SUCCEEDED}


async def test_timeout_cancels_then_retry_succeeds() -> None:
    store = MemoryStore()
    cancelled: list[int] = []

    @rollout
    async def agent(task: Any, llm: Any, rollout: AttemptedRollout) -> float:
        if rollout.attempt.sequence_id == 1:
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                cancelled.append(1)
                raise
        return 0.5

    ro = await store.enqueue_rollout({"q": 1}, config=RolloutConfig(timeout_s=0.2, max_attempts=2))
    with anyio.fail_after(10):
        stats = await Runner(agent, store).run(max_rollouts=2)
    assert cancelled == [1]
    assert (stats.timeout, stats.succeeded) == (1, 1)
    attempts = await store.list_attempts(ro.rollout_id)
    assert [a.status for a in attempts] == [AttemptStatus.TIMEOUT, AttemptStatus.SUCCEEDED]
    assert attempts[0].error is not None and "timeout_s=0.2" in attempts[0].error.message
    assert (await store.get_rollout(ro.rollout_id)).status is RolloutStatus.SUCCEEDED
    spans = await store.query_spans(ro.rollout_id)
    assert [s.payload.value for s in spans if s.kind == "reward"] == [0.5]


async def test_exception_recorded_with_traceback() -> None:
    store = MemoryStore()

    @rollout
    async def exploding_agent(task: Any, llm: Any) -> float:
        raise ValueError(f"bad task {task['n']}")

    ro = await store.enqueue_rollout({"n": 7})
    with anyio.fail_after(5):
        stats = await Runner(exploding_agent, store).run(max_rollouts=1)
    assert stats.failed == 1
    (attempt,) = await store.list_attempts(ro.rollout_id)
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None
    assert attempt.error.type == "ValueError" and attempt.error.message == "bad task 7"
    assert attempt.error.traceback is not None
    assert "exploding_agent" in attempt.error.traceback and "raise ValueError" in attempt.error.traceback
    assert (await store.get_rollout(ro.rollout_id)).status is RolloutStatus.FAILED


async def test_failure_is_retried_and_second_attempt_succeeds() -> None:
    store = MemoryStore()

    @rollout
    def flaky(task: Any, llm: Any, rollout: AttemptedRollout) -> float:
        if rollout.attempt.sequence_id == 1:
            raise ConnectionError("first try fails")
        return 1.0

    ro = await store.enqueue_rollout({}, config=RolloutConfig(max_attempts=2))
    with anyio.fail_after(5):
        stats = await Runner(flaky, store).run(max_rollouts=2)
    assert (stats.failed, stats.succeeded) == (1, 1)
    assert await _statuses(store, ro.rollout_id) == [AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]
    rollout_after = await store.get_rollout(ro.rollout_id)
    assert rollout_after.status is RolloutStatus.SUCCEEDED and rollout_after.num_attempts == 2


async def test_max_rollouts_leaves_the_rest_queued() -> None:
    store = MemoryStore()
    ids = [(await store.enqueue_rollout({"reward": i})).rollout_id for i in range(5)]
    from tests.runner_fixtures import echo_agent

    with anyio.fail_after(5):
        stats = await Runner(echo_agent, store, concurrency=2).run(max_rollouts=3)
    assert stats.attempts == 3
    statuses = [(await store.get_rollout(rid)).status for rid in ids]
    assert statuses == [RolloutStatus.SUCCEEDED] * 3 + [RolloutStatus.QUEUED] * 2
    with anyio.fail_after(5):
        assert (await Runner(echo_agent, store).run(max_rollouts=0)).attempts == 0


@asynccontextmanager
async def _open_store(kind: str, tmp_path: Path) -> AsyncIterator[Store]:
    """A real store of each backend; "http" is a StoreClient talking to a MemoryStore on a loopback port."""
    if kind == "memory":
        yield MemoryStore()
    elif kind == "sqlite":
        store = SQLiteStore(tmp_path / "s.db")
        yield store
        await store.close()
    else:
        async with StoreServer(MemoryStore()) as server:
            client = StoreClient(server.url)
            yield client
            await client.close()


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory", "sqlite", "http"])
async def test_stop_cancels_in_flight_attempts(store_kind: str, tmp_path: Path) -> None:
    async with _open_store(store_kind, tmp_path) as store:
        await _stop_cancels_in_flight_attempts(store)


async def _stop_cancels_in_flight_attempts(store: Store) -> None:
    started = anyio.Event()
    running: list[str] = []

    @rollout
    async def hangs(task: Any, llm: Any, rollout: AttemptedRollout) -> float:
        running.append(rollout.rollout_id)
        if len(running) == 3:
            started.set()
        await anyio.sleep(3600)
        return 1.0

    ids = [
        (await store.enqueue_rollout({}, config=RolloutConfig(max_attempts=2))).rollout_id for _ in range(3)
    ]
    runner = Runner(hangs, store, concurrency=3)
    result: list[Any] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                result.append(await runner.run())

            tg.start_soon(run)
            await started.wait()
            assert runner.running
            runner.stop()
    assert not runner.running
    assert result[0].stopped == 3
    for rid in ids:
        (attempt,) = await store.list_attempts(rid)
        assert attempt.status is AttemptStatus.FAILED
        assert attempt.error is not None and attempt.error.type == "RunnerStopped"
        assert (await store.get_rollout(rid)).status is RolloutStatus.REQUEUED  # retry_on has failed


async def test_stop_without_cancel_lets_attempts_finish() -> None:
    store = MemoryStore()
    started = anyio.Event()

    @rollout
    async def slow(task: Any, llm: Any) -> float:
        started.set()
        await anyio.sleep(0.2)
        return 1.0

    ro = await store.enqueue_rollout({})
    await store.enqueue_rollout({})
    runner = Runner(slow, store)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await started.wait()
            runner.stop(cancel_running=False)
    assert await _statuses(store, ro.rollout_id) == [AttemptStatus.SUCCEEDED]
    assert runner.stats.attempts == 1  # the second rollout was not taken


@pytest.mark.timeout(30)
async def test_stop_before_run_starts_makes_run_return_at_once() -> None:
    """The trainer schedules ``runner.run`` and may call ``stop()`` before that task has started
    (issue 15: a re-run of a finished run hung here). The stop must not be lost: ``run`` returns at
    once without taking a rollout, and the runner can run again afterwards."""
    store = MemoryStore()
    await store.enqueue_rollout({})

    @rollout
    async def agent(task: Any, llm: Any) -> float:
        return 1.0

    runner = Runner(agent, store)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            runner.stop()  # run() has not started yet
    assert runner.stats.attempts == 0
    with anyio.fail_after(5):
        stats = await runner.run(max_rollouts=1)  # the stop was consumed: a later run works
    assert stats.succeeded == 1


async def test_per_rollout_lines_are_debug_and_each_distinct_error_warns_once() -> None:
    """issue 15: two INFO lines per rollout flooded the console (374 lines in 3 minutes)."""
    from structlog.testing import capture_logs

    store = MemoryStore()

    @rollout
    async def agent(task: Any, llm: Any) -> float:
        if task["i"] % 2:
            raise ValueError(f"bad task kind {task['i'] % 4}")  # two distinct messages
        return 1.0

    for i in range(8):
        await store.enqueue_rollout({"i": i}, config=RolloutConfig(max_attempts=1))
    with capture_logs() as events, anyio.fail_after(10):
        stats = await Runner(agent, store, concurrency=4).run(max_rollouts=8)
    assert (stats.succeeded, stats.failed) == (4, 4)
    per_attempt = [e for e in events if e["event"].startswith("attempt_")]
    assert per_attempt  # (debug events are captured only while structlog's level lets them through)
    loud = [e for e in per_attempt if e["log_level"] != "debug"]
    assert sorted(e["error"] for e in loud) == ["ValueError: bad task kind 1", "ValueError: bad task kind 3"]
    assert all(e["log_level"] == "warning" and e["event"] == "attempt_failed" for e in loud)
    # issue 46: where the agent raised (this file), and its traceback without agentloop's frames
    assert all(e["where"].startswith(f"{os.path.relpath(__file__)}:") for e in loud)
    assert all(e["where"].endswith(" in agent") for e in loud)
    assert all("agentloop/runner.py" not in e["exception"] for e in loud)
    assert all("frames of agentloop hidden]" in e["exception"] for e in loud)
    assert all(e["exception"].endswith(e["error"]) for e in loud)


async def test_stop_from_another_thread() -> None:
    store = MemoryStore()

    @rollout
    def blocking(task: Any, llm: Any) -> float:
        time.sleep(0.05)
        return 1.0

    for _ in range(3):
        await store.enqueue_rollout({})
    runner = Runner(blocking, store)
    timer = threading.Timer(0.3, runner.stop)  # after the queue is drained the runner idles
    timer.start()
    with anyio.fail_after(5):
        stats = await runner.run()
    timer.join()
    assert stats.succeeded == 3


async def test_heartbeats_keep_attempt_alive() -> None:
    store = MemoryStore()

    @rollout
    async def slow(task: Any, llm: Any) -> float:
        for _ in range(8):
            await anyio.sleep(0.1)
            assert await store.check_timeouts() == []  # the watchdog finds nothing overdue
        return 1.0

    ro = await store.enqueue_rollout({}, config=RolloutConfig(unresponsive_s=0.3))
    with anyio.fail_after(5):
        stats = await Runner(slow, store).run(max_rollouts=1)
    assert stats.succeeded == 1, await store.list_attempts(ro.rollout_id)
    (attempt,) = await store.list_attempts(ro.rollout_id)
    assert attempt.last_heartbeat_time > attempt.start_time + 0.5


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory", "http"])
async def test_attempt_ended_by_store_is_abandoned(store_kind: str, tmp_path: Path) -> None:
    async with _open_store(store_kind, tmp_path) as store:
        await _attempt_ended_by_store_is_abandoned(store)


async def _attempt_ended_by_store_is_abandoned(store: Store) -> None:
    cancelled = anyio.Event()

    class Waits(Agent):
        async def rollout(self, task: Any, resources: Any, rollout: AttemptedRollout) -> float:
            await store.cancel_rollout(rollout.rollout_id)  # the user cancels it while it runs
            try:
                await anyio.sleep(30)
            finally:
                cancelled.set()
            return 1.0

    ro = await store.enqueue_rollout({})
    with anyio.fail_after(5):
        stats = await Runner(Waits(), store, heartbeat_interval=0.05).run(max_rollouts=1)
    assert cancelled.is_set() and stats.lost == 1
    assert (await store.get_rollout(ro.rollout_id)).status is RolloutStatus.CANCELLED


class WatchdogFirst(MemoryStore):
    """A store whose watchdog times an attempt out just before the runner reports the timeout itself
    (what a loaded machine does: both use timeout_s): the runner's own report is then refused."""

    async def update_attempt(self, rollout_id: str, attempt_id: str, **fields: Any) -> Any:
        if fields.get("status") is AttemptStatus.TIMEOUT:
            await super().update_attempt(rollout_id, attempt_id, status=AttemptStatus.TIMEOUT)
        return await super().update_attempt(rollout_id, attempt_id, **fields)


async def test_a_timeout_the_stores_watchdog_reported_first_counts_as_a_timeout_not_lost() -> None:
    """tests/reliability's retry test saw (failed, timeout, succeeded) = (1, 0, 2) with lost 1 under load."""

    @rollout
    async def hangs(task: dict[str, Any], llm: Any) -> float:
        await anyio.sleep(3600)
        return 1.0

    store = WatchdogFirst()
    ro = await store.enqueue_rollout({}, config=RolloutConfig(timeout_s=0.2, max_attempts=1))
    with anyio.fail_after(10):
        stats = await Runner(hangs, store).run(max_rollouts=1)
    assert (stats.timeout, stats.lost) == (1, 0)
    assert [a.status for a in await store.list_attempts(ro.rollout_id)] == [AttemptStatus.TIMEOUT]


async def test_runner_rejects_bad_arguments() -> None:
    store = MemoryStore()

    @rollout
    async def agent(task: Any, llm: Any) -> float:
        return 1.0

    with pytest.raises(ValueError, match="concurrency must be an int >= 1, got 0"):
        Runner(agent, store, concurrency=0)
    with pytest.raises(TypeError, match=r"Runner expects an al\.Agent"):
        Runner(42, store)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Runner expects a Store"):
        Runner(agent, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="call it first"):
        Runner(Agent, store)
    with pytest.raises(ValueError, match="poll_interval"):
        Runner(agent, store, poll_interval=0)
    with pytest.raises(TypeError, match="max_rollouts must be an int"):
        await Runner(agent, store).run(max_rollouts="3")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="main thread"):
        await anyio.to_thread.run_sync(lambda: anyio.run(Runner(agent, store).run, 0, True))


async def test_plain_function_is_accepted() -> None:
    store = MemoryStore()

    async def plain(task: Any, llm: Any) -> int:
        return 3

    ro = await store.enqueue_rollout({})
    with anyio.fail_after(5):
        await Runner(plain, store).run(max_rollouts=1)
    spans = await store.query_spans(ro.rollout_id)
    assert [(s.payload.kind, s.payload.value, s.payload.name) for s in spans] == [("reward", 3.0, "final")]


def test_run_sync() -> None:
    from tests.runner_fixtures import echo_agent

    store = MemoryStore()
    ro = anyio.run(store.enqueue_rollout, {"reward": 2})
    stats = Runner(echo_agent, store).run_sync(max_rollouts=1)
    assert stats.succeeded == 1
    assert anyio.run(store.get_rollout, ro.rollout_id).status is RolloutStatus.SUCCEEDED


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sig", "kind"),
    [(signal.SIGTERM, "async"), (signal.SIGINT, "async"), (signal.SIGTERM, "sync")],
    ids=["SIGTERM-async", "SIGINT-async", "SIGTERM-sync"],
)
@pytest.mark.e2e
async def test_signal_stops_runner_process_cleanly(sig: signal.Signals, kind: str, tmp_path: Path) -> None:
    """A real runner process on a SQLite store gets a real signal: it exits 0 (also with sync agents
    stuck in threads) and leaves no attempt running."""
    db = tmp_path / "store.db"
    store = SQLiteStore(db)
    ids = [
        (await store.enqueue_rollout({"i": i}, config=RolloutConfig(max_attempts=2))).rollout_id
        for i in range(3)
    ]
    await store.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runner_fixtures", str(db), "3", kind],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        started = 0
        with anyio.move_on_after(
            60
        ):  # abandon_on_cancel: a runner that never starts fails here, not at 300 s
            while started < 3:
                line = await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
                assert line, f"runner exited early: {proc.stderr.read() if proc.stderr else ''}"
                started += line.startswith("started")
        if started < 3:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"the runner started {started} of 3 agents in 60 s; its stderr:\n{err}")
        proc.send_signal(sig)
        out, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=20))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped 3" in out
    store = SQLiteStore(db)
    try:
        for rid in ids:
            (attempt,) = await store.list_attempts(rid)
            assert attempt.status is AttemptStatus.FAILED, attempt
            assert attempt.error is not None and attempt.error.type == "RunnerStopped"
            assert (await store.get_rollout(rid)).status is RolloutStatus.REQUEUED
    finally:
        await store.close()
