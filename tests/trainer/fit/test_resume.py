"""Kill a training process right after a checkpoint, resume, and get the same next step as without the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.resume_job import TASKS, config, seeded_agent
from trainer import Trainer

COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "batch/samples")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_resume_after_kill_matches_uninterrupted_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    # the uninterrupted reference: 3 steps in one go
    ref = Trainer(config(str(tiny_model_dir), str(tmp_path / "ref"), 3)).fit(seeded_agent, TASKS)
    expected = ref.history[2]

    # the same job in a subprocess (its own process group: Ray's helpers die with it), killed once
    # the step-2 checkpoint is published
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.resume_job", str(tiny_model_dir), str(run_dir), "3"],
        cwd=Path(__file__).resolve().parents[3],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    try:
        while not (latest.exists() and latest.read_text().strip() == "2"):
            assert proc.poll() is None, "the job ended before its step-2 checkpoint"
            assert time.monotonic() < deadline, "no step-2 checkpoint within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [r["step"] for r in _rows(run_dir)][:2] == [1, 2]

    # resume in this process: it continues at step 3 from the checkpoint
    resumed = Trainer(config(str(tiny_model_dir), str(run_dir), 3)).fit(seeded_agent, TASKS)
    assert resumed.steps == 3
    assert len(resumed.history) == 1
    got = resumed.history[0]
    assert got["step"] == 3
    for key in COMPARED:
        assert abs(got[key] - expected[key]) < 1e-4, (key, got[key], expected[key])


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
def test_async_checkpoint_records_the_first_untrained_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With max_staleness 1 the next batch is already enqueued when step 1 checkpoints; the saved data
    position must point at that batch, so a resume re-draws it instead of skipping it."""
    cfg = config(str(tiny_model_dir), str(tmp_path / "async"), 2)
    cfg["actor_rollout_ref"]["rollout"]["max_staleness"] = 1
    Trainer(cfg).fit(seeded_agent, TASKS)
    state = json.loads(
        (tmp_path / "async" / "checkpoints" / "global_step_1" / "trainer_state.json").read_text()
    )
    batch = cfg["data"]["train_batch_size"]
    assert state["cursor"]["position"] == batch  # one batch trained; the second (enqueued) is not counted


def test_commit_fsyncs_the_step_files_and_folders_before_latest_names_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss after ``latest`` is replaced must not find it naming weights the disk never got:
    every file of the step folder (written by another process: the Ray worker) and the folders are
    fsynced before the rename, and the folder holding ``latest`` after it. (os.fsync and os.replace are
    wrapped to record the order; /proc names each fsynced descriptor's file.)"""
    from trainer.run_folder import checkpoint as ck

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the fsynced files")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        events.append(("replace", str(Path(dst).resolve())))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = (tmp_path / "checkpoints").resolve()
    manager = ck.CheckpointManager(root)
    step = manager.begin(4)
    (step / ck.WEIGHTS_FILE).write_bytes(b"w" * 4096)  # as the worker's save_policy leaves them
    (step / ck.OPTIMIZER_FILE).write_bytes(b"o" * 512)
    manager.commit(4, {"step": 4, "cursor": {"epoch": 0, "position": 8, "seed": 0}})

    published = events.index(("replace", str(root / "latest")))
    synced_before = {path for kind, path in events[:published] if kind == "fsync"}
    state = step / "trainer_state.json.tmp"  # fsynced under its temporary name, then renamed
    needed = {str(step / ck.WEIGHTS_FILE), str(step / ck.OPTIMIZER_FILE), str(state), str(step), str(root)}
    assert needed <= synced_before, needed - synced_before
    assert ("fsync", str(root)) in events[published:]  # the rename itself is on disk
    assert manager.latest() is not None and manager.latest()[1]["step"] == 4  # type: ignore[index]
