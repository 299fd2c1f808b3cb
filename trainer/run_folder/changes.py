"""What differs between the run a folder holds and the run about to start there, and which of those
differences a run may take when it continues from its checkpoint.

A run's identity (``checkpoint.run_identity``) is a digest of its config and inputs. When a folder
holds a run of another identity, :func:`changes` names what differs, dotted as in a job file::

    trainer.total_training_steps: 4 -> 5
    actor_rollout_ref.actor.optim.lr: 1e-06 -> 1e-05
    train_data: changed

``trainer.on_config_change`` says what the new run does then (``agentloop train`` asks instead):
``new_folder`` starts it in the first free sibling (``<folder>-2``), ``error`` stops with the list, and
``resume`` continues the folder's run from its latest checkpoint with the new settings, when every change
is :data:`RESUMABLE`: how long it trains, its learning rates, its logging, its validation. Any other key
(the model, the batch, the algorithm, the training data) would leave the checkpoint's optimizer state
and data cursor belonging to another run, so a resume refuses it and names it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Dotted keys (or prefixes ending in ".") a continued run may change; each takes effect from the next step.
RESUMABLE = (
    "trainer.total_training_steps",  # how long: the loop runs on to the new total
    "trainer.total_epochs",
    "actor_rollout_ref.actor.optim.lr",  # set on the optimizer at every step (trainer/model/_read_back.py)
    "critic.optim.lr",
    "trainer.project_name",  # logging: names in W&B and TensorBoard
    "trainer.experiment_name",
    "actor_rollout_ref.rollout.val_kwargs.",  # validation: its sampling
    "val_data",  # validation: its tasks
)

INPUTS = ("train_data", "val_data", "reward")  # what a run reads besides its config, digested apart


@dataclass(frozen=True)
class Change:
    """One key that differs: its dotted name, the folder's run's value and the new run's."""

    key: str
    old: Any
    new: Any

    @property
    def resumable(self) -> bool:
        return any(self.key == k or (k.endswith(".") and self.key.startswith(k)) for k in RESUMABLE)

    def __str__(self) -> str:
        if self.key in INPUTS:
            return f"{self.key}: changed"
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return "(unset)" if value is _MISSING else json.dumps(value, default=str)


_MISSING = object()


def input_digests(train: Any, val: Any, reward: Any) -> dict[str, str]:
    """A digest of each input (train_data, val_data, the reward judge's settings), kept in run.json so
    that a later run can say which of them changed."""
    values = dict(zip(INPUTS, (train, val, reward), strict=True))
    return {
        k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
        for k, v in values.items()
    }


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree


def changes(
    old_config: dict[str, Any] | None,
    new_config: dict[str, Any],
    old_inputs: dict[str, str] | None,
    new_inputs: dict[str, str],
    keep: Any,
) -> list[Change]:
    """The keys in which the new run differs from the folder's (configs as ``model_dump(mode="json")``),
    among those that make a run's identity (``keep`` filters a config to them: ``checkpoint.identity_view``),
    then the inputs that changed. An input is named only when the folder's run.json recorded its digest."""
    old = dict(_leaves(keep(old_config))) if old_config is not None else {}
    new = dict(_leaves(keep(new_config)))
    found = [
        Change(key, old.get(key, _MISSING), new.get(key, _MISSING))
        for key in [*new, *(k for k in old if k not in new)]
        if old.get(key, _MISSING) != new.get(key, _MISSING)
    ]
    for key in INPUTS:
        if old_inputs and key in old_inputs and old_inputs[key] != new_inputs.get(key):
            found.append(Change(key, None, None))
    return found


def describe(found: list[Change]) -> str:
    """The changes as one line: ``trainer.total_training_steps: 4 -> 5; train_data: changed``."""
    return "; ".join(str(c) for c in found) or "its data or reward judge (not recorded in its run.json)"
