"""A run folder that holds a run of other settings (issue 46, item 2): the plan names the keys that differ
(dotted, old -> new) and, as ``trainer.on_config_change`` says, starts in a sibling, stops, or continues
that run from its checkpoint when only steps, learning rates, logging or validation changed. Folders are
written as a run leaves them (config.json, run.json, checkpoints/); nothing trains here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentloop.errors import ConfigError
from trainer import TrainerConfig
from trainer.run_folder import checkpoint as ck
from trainer.run_folder.changes import Change, input_digests

TRAIN = [{"q": "a"}, {"q": "b"}]


def dump(**trainer: Any) -> dict[str, Any]:
    cfg = {"trainer": {"total_training_steps": 4, **trainer}, "actor_rollout_ref": {"actor": {"optim": {}}}}
    return TrainerConfig.from_dict(cfg).model_dump(mode="json")


def with_lr(config: dict[str, Any], lr: float) -> dict[str, Any]:
    cfg = TrainerConfig.from_dict(config)
    cfg.actor_rollout_ref.actor.optim.lr = lr
    return cfg.model_dump(mode="json")


def finished_run(folder: Path, config: dict[str, Any], train: list[Any], step: int | None = 4) -> None:
    """A finished run as fit leaves it: its config, run.json (identity, input digests), a checkpoint."""
    inputs = input_digests(train, None, None)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    record = {"identity": ck.run_identity(config, train, None), "inputs": inputs, "status": "finished"}
    ck.write_run(folder, {**record, "step": 4})
    if step is not None:
        manager = ck.CheckpointManager(folder / "checkpoints")
        path = manager.begin(step)
        (path / ck.WEIGHTS_FILE).write_bytes(b"w")
        (path / ck.OPTIMIZER_FILE).write_bytes(b"o")
        manager.commit(step, {"step": step, "cursor": {"epoch": 0, "position": 2, "seed": 0}})


def plan(folder: Path, config: dict[str, Any], train: list[Any], on_change: str, **kw: Any) -> ck.RunPlan:
    identity = ck.run_identity(config, train, None)
    inputs = input_digests(train, None, None)
    return ck.plan_run(folder, "auto", identity, config, inputs=inputs, on_change=on_change, **kw)


def test_a_changed_config_names_the_keys_and_goes_to_a_sibling_by_default(tmp_path: Path) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    new = with_lr(dump(total_training_steps=5), 1e-5)
    got = plan(tmp_path / "run", new, TRAIN, "new_folder")
    assert got.action == "new" and got.run_dir == tmp_path / "run-2" and got.changed_from == tmp_path / "run"
    assert [str(c) for c in got.changes] == [
        "actor_rollout_ref.actor.optim.lr: 1e-06 -> 1e-05",
        "trainer.total_training_steps: 4 -> 5",
    ]
    assert "holds another run (actor_rollout_ref.actor.optim.lr: 1e-06 -> 1e-05; trainer." in got.note


def test_keys_that_do_not_make_the_run_never_count_as_changes(tmp_path: Path) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    same = dump(logger=["console"], save_freq=2, on_config_change="error", save_last=False)
    got = plan(tmp_path / "run", same, TRAIN, "error")
    assert got.action == "finished" and got.run_dir == tmp_path / "run" and got.changes == []


def test_error_names_what_differs_and_both_ways_on(tmp_path: Path) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    with pytest.raises(ConfigError) as info:
        plan(tmp_path / "run", dump(total_training_steps=5), [{"q": "c"}], "error")
    assert str(info.value) == (
        f"{tmp_path / 'run'} holds a run of other settings: trainer.total_training_steps: 4 -> 5; "
        "train_data: changed; continue that run with these changes with trainer.on_config_change=resume, "
        f"or start a new run in {tmp_path / 'run-2'} with trainer.on_config_change=new_folder"
    )
    options = {"resume": "--resume-with-changes", "new_folder": "--fresh"}
    with pytest.raises(
        ConfigError, match=r"with --resume-with-changes, or start a new run in .* with --fresh$"
    ):
        plan(tmp_path / "run", dump(total_training_steps=5), TRAIN, "error", options=options)


def test_resume_continues_the_folders_run_from_its_checkpoint(tmp_path: Path) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    new = with_lr(dump(total_training_steps=6, experiment_name="longer"), 1e-5)
    got = plan(tmp_path / "run", new, TRAIN, "resume")
    assert got.action == "resume" and got.run_dir == tmp_path / "run" and got.step == 4
    assert {c.key for c in got.changes} == {
        "actor_rollout_ref.actor.optim.lr",
        "trainer.total_training_steps",
        "trainer.experiment_name",
    }
    assert got.note.startswith("continued with changes: ")


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"data": {"train_batch_size": 16}}, "data.train_batch_size"),
        ({"algorithm": {"adv_estimator": "rloo"}}, "algorithm.adv_estimator"),
        ({"actor_rollout_ref": {"model": {"path": "other-model"}}}, "actor_rollout_ref.model.path"),
    ],
)
def test_resume_refuses_a_key_that_would_change_what_the_checkpoint_means(
    tmp_path: Path, change: dict[str, Any], refused: str
) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    new = TrainerConfig.from_dict({"trainer": {"total_training_steps": 5}, **change}).model_dump(mode="json")
    with pytest.raises(ConfigError) as info:
        plan(tmp_path / "run", new, TRAIN, "resume")
    message = str(info.value)
    assert message.startswith(f"cannot continue the run in {tmp_path / 'run'} with {refused} changed: ")
    assert "trainer.total_training_steps: 4 -> 5" in message  # every change is shown, the refused one named
    assert message.endswith(
        f"start a new run in {tmp_path / 'run-2'} with trainer.on_config_change=new_folder"
    )


def test_resume_refuses_changed_training_data_a_missing_checkpoint_and_fewer_steps(tmp_path: Path) -> None:
    finished_run(tmp_path / "run", dump(), TRAIN)
    with pytest.raises(ConfigError, match="with train_data changed: "):
        plan(tmp_path / "run", dump(total_training_steps=5), [{"q": "c"}], "resume")
    with pytest.raises(ConfigError, match=r"to trainer.total_training_steps=3: it is at step 4 already"):
        plan(tmp_path / "run", dump(total_training_steps=3), TRAIN, "resume")
    finished_run(tmp_path / "bare", dump(), TRAIN, step=None)
    with pytest.raises(ConfigError, match=r"it has no checkpoint \(it ran with trainer.save_last=false"):
        plan(tmp_path / "bare", dump(total_training_steps=5), TRAIN, "resume")


def test_a_resumable_key_is_one_of_steps_lrs_logging_validation() -> None:
    assert Change("trainer.total_training_steps", 1, 2).resumable
    assert Change("critic.optim.lr", 1e-5, 1e-4).resumable
    assert Change("actor_rollout_ref.rollout.val_kwargs.temperature", 0, 0.6).resumable
    assert Change("val_data", None, None).resumable
    assert not Change("actor_rollout_ref.rollout.temperature", 1.0, 0.6).resumable
    assert not Change("actor_rollout_ref.actor.optim.lr_warmup_steps", 0, 5).resumable
    assert str(Change("trainer.experiment_name", "a", "b")) == 'trainer.experiment_name: "a" -> "b"'
