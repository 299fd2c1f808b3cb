"""A process SIGKILLed while writing to a SQLiteStore loses no rollout it reported enqueued or finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agentloop.store.sqlite import SQLiteStore
from agentloop.types import RolloutStatus

CHILD = """
import sys, anyio
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import Reward, Span

async def main() -> None:
    store = SQLiteStore(sys.argv[1])
    async def worker(i: int) -> None:
        while True:
            rollout = await store.enqueue_rollout({"i": i})
            print("enqueued", rollout.rollout_id, flush=True)
            attempted = await store.dequeue_rollout(f"w{i}")
            if attempted is None:
                continue
            aid = attempted.attempt.attempt_id
            await store.add_span(Span(rollout_id=attempted.rollout_id, attempt_id=aid, payload=Reward(value=1)))
            await store.update_attempt(attempted.rollout_id, aid, status="succeeded")
            print("finished", attempted.rollout_id, flush=True)
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(worker, i)

anyio.run(main)
"""


@pytest.mark.e2e
async def test_sigkill_loses_no_finished_rollout(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    enqueued: set[str] = set()
    finished: set[str] = set()
    assert proc.stdout is not None
    try:
        with anyio.fail_after(45):
            while len(finished) < 150:
                line = await anyio.to_thread.run_sync(proc.stdout.readline)
                assert line, f"child exited early: {proc.stderr.read() if proc.stderr else ''}"
                kind, rid = line.split()
                (enqueued if kind == "enqueued" else finished).add(rid)
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the child is writing all the time
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    store = SQLiteStore(db)
    try:
        for rid in finished:
            assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED, rid
        for rid in enqueued:
            await store.get_rollout(rid)  # raises NotFoundError if it was lost
        every = await store.list_rollouts()
        assert len(every) >= len(enqueued)
        # the store is usable after the crash: the queue and the state machine still work
        queued = [r for r in every if r.status is RolloutStatus.QUEUED]
        if queued:
            attempted = await store.dequeue_rollout("after-crash")
            assert attempted is not None and attempted.rollout_id == queued[0].rollout_id
    finally:
        await store.close()
