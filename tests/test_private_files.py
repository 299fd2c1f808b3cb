"""Run folders and stores only their owner can read (issue 44 finding 6): with the usual umask 022 a run
folder was 0755 and store.db / agentloop-serve.db (every task, rollout and app conversation) 0644."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.private_files import private_dir, private_file, tighten_tree, write_private_text
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import Log, Span
from trainer.run_folder import checkpoint as ck


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The umask most systems start users with: what the review ran under."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def shared(root: Path) -> list[str]:
    """Everything under ``root`` (itself included) that group or other can read, write or enter."""
    found = [p for p in (root, *root.rglob("*")) if not p.is_symlink()]
    return [f"{p.relative_to(root.parent)} {oct(mode(p))}" for p in found if mode(p) & 0o077]


async def test_a_sqlite_store_and_its_wal_files_are_the_owners_only(tmp_path: Path) -> None:
    for name in ("store.db", "agentloop-serve.db"):
        path = tmp_path / name
        store = SQLiteStore(path)
        try:
            rollout = await store.enqueue_rollout({"secret": "the answer is 42"})
            attempt = await store.dequeue_rollout("w")
            assert attempt is not None
            log = Log(message="m")
            await store.add_span(
                Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt.attempt_id, payload=log)
            )
            files = sorted(p.name for p in tmp_path.glob(name + "*"))
            assert files == [name, name + "-shm", name + "-wal"]  # WAL mode: all three exist while open
            assert {f: oct(mode(tmp_path / f)) for f in files} == {f: "0o600" for f in files}
        finally:
            await store.close()


async def test_an_existing_world_readable_store_is_tightened_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = SQLiteStore(path)
    await store.enqueue_rollout({"q": 1})
    await store.close()
    path.chmod(0o644)  # what stores written before this fix are
    store = SQLiteStore(path)
    try:
        await store.enqueue_rollout({"q": 2})
        assert mode(path) == 0o600 and mode(tmp_path / "store.db-wal") == 0o600
    finally:
        await store.close()


def test_a_run_folder_and_everything_in_it_are_the_owners_only(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "project" / "run"
    run_dir.mkdir(parents=True)  # as a caller may have made it: 0755
    (run_dir / "config.json").write_text("{}")  # 0644
    manager = ck.CheckpointManager(run_dir / "checkpoints")
    step = manager.begin(1)
    (step / "model.safetensors").write_bytes(b"weights")  # as a worker writes it: 0644
    manager.commit(1, {"step": 1})
    (run_dir / "metrics.jsonl").write_text("{}\n")  # as the metrics logger writes it
    ck.write_run(run_dir, {"status": "running"})
    assert mode(run_dir) == 0o700 and shared(run_dir) == []
    assert mode(run_dir / "run.json") == 0o600 and mode(step / "model.safetensors") == 0o600
    private_dir(run_dir / "new")
    write_private_text(run_dir / "new" / "config.json", "{}")
    assert mode(run_dir / "new") == 0o700 and mode(run_dir / "new" / "config.json") == 0o600


def test_the_helpers(tmp_path: Path) -> None:
    made = private_file(tmp_path / "a.db")
    assert made.read_bytes() == b"" and mode(made) == 0o600
    other = tmp_path / "b"
    other.write_text("x")
    other.chmod(0o664)
    private_file(other)
    assert mode(other) == 0o600 and other.read_text() == "x"  # tightened, not emptied
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("x")
    (tree / "link").symlink_to("/etc/hostname")  # links are not followed
    tighten_tree(tree)
    assert shared(tree) == [] and mode(Path("/etc/hostname")) & 0o044
