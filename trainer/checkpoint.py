"""Checkpoints that a crash cannot tear, and the data cursor they record.

Layout under ``<run_dir>/checkpoints``::

    global_step_4/actor.pt          model + optimizer + actor step (written by the worker)
    global_step_4/trainer_state.json  step, data cursor (epoch, position, seed)
    latest                          the step of the last *complete* checkpoint

``latest`` is replaced atomically after both files are on disk, so a process killed while saving
leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any


class DataCursor:
    """Walks a dataset in batches, reshuffled each epoch from (seed, epoch); its state is two ints."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        if batch_size < 1 or size < batch_size:
            raise ValueError(f"a dataset of {size} tasks cannot fill a batch of {batch_size}")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size  # the incomplete tail batch of an epoch is skipped

    def _order(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, data: list[Any]) -> list[tuple[int, Any]]:
        """The next ``batch_size`` (index, task) pairs, moving to the next epoch when this one is used up."""
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [(i, data[i]) for i in order]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint was written with seed {state['seed']}, this run uses {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class CheckpointManager:
    """Creates step folders and publishes the latest complete one."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def begin(self, step: int) -> Path:
        path = self.root / f"global_step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, step: int, state: dict[str, Any]) -> None:
        path = self.root / f"global_step_{step}"
        _atomic_write(path / "trainer_state.json", json.dumps(state))
        _atomic_write(self.root / "latest", str(step))

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        marker = self.root / "latest"
        if not marker.exists():
            return None
        return self.load_path(self.root / f"global_step_{int(marker.read_text().strip())}")

    def load_path(self, path: Path) -> tuple[Path, dict[str, Any]]:
        state_file = path / "trainer_state.json"
        if not state_file.exists() or not (path / "actor.pt").exists():
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (needs actor.pt and trainer_state.json)"
            )
        return path, json.loads(state_file.read_text())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
