"""``agentloop train``'s job file (flat layout, the old nested form, ``--set``, paths relative to the
file) and the CLI's one-line errors, run in-process through ``agentloop.cli.main`` (no training)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentloop.cli import UsageError, main
from agentloop.commands.train import CONFIG_SECTIONS, load_job
from agentloop.logging import get_logger

AGENT = """
import agentloop as al

@al.rollout
async def agent(task, llm):
    return 1.0
"""


def _job(folder: Path, doc: dict, agent_module: str, name: str = "job.yaml") -> Path:
    """A job folder: the agent as ``<agent_module>.py``, two tasks in train.jsonl, the job file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{agent_module}.py").write_text(AGENT)
    (folder / "train.jsonl").write_text('{"q": "a"}\n{"q": "b"}\n')
    path = folder / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI's stderr, which must be exactly one line."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- the job file


def test_help_lists_the_config_sections_and_a_set_example(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer import TrainerConfig

    assert set(CONFIG_SECTIONS) == set(TrainerConfig.model_fields)  # the help text's list has not drifted
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--set trainer.total_training_steps=2" in out
    assert "relative to the file" in out
    assert all(section in out for section in CONFIG_SECTIONS)


def test_flat_job_resolves_every_path_against_the_file(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_dir = tmp_path / "capitals"
    doc = {
        "agent": "flat_agent_file.py:agent",
        "train_data": "train.jsonl",
        "val_data": "train.jsonl",
        "data": {"train_batch_size": 16},
        "actor_rollout_ref": {"model": {"path": os.path.relpath(tiny_model_dir, job_dir)}},
        "trainer": {"total_training_steps": 3, "default_local_dir": "out"},
    }
    path = _job(job_dir, doc, "flat_agent_file")
    monkeypatch.chdir(tmp_path)  # the parent folder, as in `agentloop train capitals/job.yaml`
    job = load_job(Path("capitals/job.yaml"), ["trainer.total_training_steps=2"])
    assert job.agent.__module__ == "flat_agent_file"  # imported from the job's folder
    assert job.train == [{"q": "a"}, {"q": "b"}] and job.val == job.train
    assert job.config.actor_rollout_ref.model.path == str(tiny_model_dir.resolve())
    assert job.config.trainer.default_local_dir == str(path.parent.resolve() / "out")
    assert job.config.trainer.total_training_steps == 2 and job.config.data.train_batch_size == 16


def test_agent_module_is_found_next_to_the_job_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _job(
        tmp_path / "job",
        {"agent": "module_beside_job:agent", "train_data": "train.jsonl"},
        "module_beside_job",
    )
    monkeypatch.chdir(tmp_path)
    job = load_job(Path("job/job.yaml"))
    assert job.agent.__module__ == "module_beside_job"


def test_nested_form_still_reads_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sections = {"data": {"train_batch_size": 16}, "trainer": {"total_training_steps": 4}}
    flat = _job(
        tmp_path, {"agent": "nested_agent:agent", "train_data": "train.jsonl", **sections}, "nested_agent"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        yaml.safe_dump({"agent": "nested_agent:agent", "train_data": "train.jsonl", "trainer": sections})
    )
    monkeypatch.chdir(tmp_path)
    new_notes: list[str] = []
    old_notes: list[str] = []
    new = load_job(flat, ["trainer.seed=7"], note=new_notes.append)
    old = load_job(nested, ["trainer.seed=7"], note=old_notes.append)
    assert old.config.trainer.run_dir == tmp_path / "runs" / "nested"  # each job file its own run folder
    assert new.config.trainer.run_dir == tmp_path / "runs" / "job"
    old.config.trainer.default_local_dir = new.config.trainer.default_local_dir
    assert old.config == new.config and old.config.trainer.seed == 7
    assert new_notes == [] and len(old_notes) == 1 and "deprecated" in old_notes[0]
    assert "data, trainer" in old_notes[0] and "top level" in old_notes[0]


def test_the_run_folder_is_beside_the_job_file_named_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 46 item 2: every job defaulted to runs/agentloop/default under the working folder."""
    path = _job(
        tmp_path / "proj",
        {"agent": "folder_agent:agent", "train_data": "train.jsonl"},
        "folder_agent",
        "qa.yaml",
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_job(Path("../proj/qa.yaml")).config.trainer.run_dir == path.parent / "runs" / "qa"
    named = load_job(Path("../proj/qa.yaml"), ["trainer.experiment_name=lr-sweep"]).config.trainer
    assert named.run_dir == path.parent / "runs" / "lr-sweep"
    chosen = load_job(Path("../proj/qa.yaml"), ["trainer.default_local_dir=out"]).config.trainer
    assert chosen.run_dir == tmp_path / "elsewhere" / "out"  # --set paths: the working folder's


def test_a_changed_key_stops_before_anything_loads_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run folder holds a finished 3-step run of this job; asking for 2 steps names the key."""
    from trainer.run_folder import checkpoint as ck

    doc = {
        "agent": "changed_agent:agent",
        "train_data": "train.jsonl",
        "trainer": {"total_training_steps": 3},
    }
    path = _job(tmp_path, doc, "changed_agent")
    monkeypatch.chdir(tmp_path)
    job = load_job(path)
    run = tmp_path / "runs" / "job"
    run.mkdir(parents=True)
    (run / "config.json").write_text(job.config.model_dump_json())
    ck.write_run(run, {"identity": "another", "status": "finished", "step": 3})
    assert main(["train", "job.yaml", "--set", "trainer.total_training_steps=2"]) == 2
    assert _err_line(capsys) == (
        f"agentloop train: error: {run} holds a run of other settings: trainer.total_training_steps: 3 -> 2; "
        "continue that run with these changes with --resume-with-changes, or start a new run in "
        f"{run.with_name('job-2')} with --fresh"
    )
    assert (
        main(["train", "job.yaml", "--set", "trainer.total_training_steps=5", "--resume-with-changes"]) == 2
    )
    assert "it has no checkpoint" in _err_line(capsys)
    assert main(["train", "job.yaml", "--more-steps", "0"]) == 2
    assert _err_line(capsys) == "agentloop train: error: --more-steps must be at least 1, got 0"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "changed_agent.py",
        "job.yaml",
        "runs",
        "train.jsonl",
    ]


def test_set_keys_are_the_job_file_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _job(
        tmp_path / "job", {"agent": "set_keys_agent:agent", "train_data": "train.jsonl"}, "set_keys_agent"
    )
    (tmp_path / "other.jsonl").write_text('{"q": "c"}\n')
    monkeypatch.chdir(tmp_path)
    job = load_job(
        path, ["train_data=other.jsonl", "actor_rollout_ref.actor.optim.lr=1e-5", "trainer.logger=[jsonl]"]
    )
    assert job.train == [{"q": "c"}]  # a path given on the command line is relative to the working folder
    assert job.config.actor_rollout_ref.actor.optim.lr == 1e-5 and job.config.trainer.logger == ["jsonl"]
    with pytest.raises(UsageError, match=r"write trainer\.<key>, not trainer\.trainer\.<key>"):
        load_job(path, ["trainer.trainer.total_training_steps=2"])
    with pytest.raises(
        UsageError, match=re.escape("--set 'data.train_batch_size.x=1': 'data.train_batch_size' is a value")
    ):
        load_job(path, ["data.train_batch_size=2", "data.train_batch_size.x=1"])
    with pytest.raises(UsageError, match="must look like KEY=VALUE"):
        load_job(path, ["trainer.seed"])


# ---------------------------------------------------------------- one-line errors


def test_missing_job_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "capitals/job.yaml"]) == 2
    assert _err_line(capsys) == (
        f"agentloop train: error: job file 'capitals/job.yaml' does not exist (working folder: {tmp_path})"
    )


def test_bad_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.yaml").write_text("agent: a:b\ntrain_data: [t.jsonl\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml"]) == 2
    line = _err_line(capsys)
    assert line.startswith("agentloop train: error: job.yaml is not valid YAML: ") and "line 3" in line


def test_unknown_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {"agent": "x:y", "train_data": "t.jsonl", "trainer": {"total_training_step": 2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml"]) == 2
    assert _err_line(capsys) == (
        "agentloop train: error: job.yaml: unknown key 'trainer.total_training_step'; "
        "did you mean 'total_training_steps'?"
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"agent": "x:y", "train_data": "t.jsonl", "oops": 1}))
    assert main(["train", "job.yaml"]) == 2
    assert (
        "unknown top-level keys ['oops']; allowed: agent, train_data, val_data, reward, algorithm"
        in _err_line(capsys)
    )


def test_bad_model_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc: dict[str, Any] = {"agent": "model_path_agent:agent", "train_data": "train.jsonl"}
    doc["actor_rollout_ref"] = {"model": {"path": "./models/mine"}}
    _job(tmp_path / "job", doc, "model_path_agent")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job/job.yaml"]) == 2
    missing = tmp_path / "job" / "models" / "mine"
    assert _err_line(capsys) == (
        f"agentloop train: error: actor_rollout_ref.model.path: model folder '{missing}' does not exist"
    )


def test_agent_import_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _job(tmp_path, {"agent": "raising_agent.py:agent", "train_data": "train.jsonl"}, "raising_agent")
    (tmp_path / "raising_agent.py").write_text("import json\n\nraise RuntimeError('no API key set')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", path.name]) == 2
    assert _err_line(capsys) == (
        f"agentloop train: error: agent '{tmp_path / 'raising_agent.py'}:agent': importing 'raising_agent' "
        f"failed: RuntimeError: no API key set ({tmp_path / 'raising_agent.py'}, line 3)"
    )
    path.write_text(yaml.safe_dump({"agent": "no_such_module_xyz:agent", "train_data": "train.jsonl"}))
    assert main(["train", path.name]) == 2
    assert f"no module named 'no_such_module_xyz' in {tmp_path}, the working folder (" in _err_line(capsys)
    path.write_text(yaml.safe_dump({"agent": "json:nope", "train_data": "train.jsonl"}))
    assert main(["train", path.name]) == 2
    assert (
        _err_line(capsys)
        == "agentloop train: error: agent 'json:nope': module 'json' has no attribute 'nope'"
    )


def test_missing_train_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _job(tmp_path, {"agent": "data_agent:agent", "train_data": "data/train.jsonl"}, "data_agent")
    monkeypatch.chdir(tmp_path.parent)
    assert main(["train", str(path.relative_to(tmp_path.parent))]) == 2
    assert _err_line(capsys) == (
        f"agentloop train: error: train_data: file '{tmp_path / 'data' / 'train.jsonl'}' does not exist"
    )


def test_other_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _job(
        tmp_path, {"agent": "tasks_agent:agent", "train_data": "tasks_agent:make_tasks"}, "tasks_agent"
    )
    (tmp_path / "tasks_agent.py").write_text(AGENT + "\ndef make_tasks():\n    return {}['split']\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", path.name]) == 1  # not a usage error: the user's own function failed
    assert _err_line(capsys) == (
        "agentloop train: error: KeyError: 'split' (run again with --debug for the traceback)"
    )
    with pytest.raises(KeyError, match="split"):
        main(["train", path.name, "--debug"])
    with pytest.raises(UsageError, match="does not exist"):
        main(["--debug", "train", "missing.yaml"])


# ---------------------------------------------------------------- logging


def test_per_rollout_events_print_only_with_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--log-format", "json"]) == 0
    get_logger("agentloop.runner").info("attempt_started", rollout_id="ro-1", attempt_id="at-1")
    get_logger("agentloop.runner").warning("attempt_finished", rollout_id="ro-2", status="failed")
    get_logger("agentloop.trainer").info("step", step=1)
    err = capsys.readouterr().err
    events = [json.loads(line)["event"] for line in err.splitlines()]  # JSON lines, as asked
    assert events == ["attempt_finished", "step"]
    assert main(["--log-format", "json", "-v", "version"]) == 0
    get_logger("agentloop.runner").info("attempt_started", rollout_id="ro-1", attempt_id="at-1")
    get_logger("agentloop.runner").debug("attempt_finished", rollout_id="ro-1", status="succeeded")
    events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events == ["attempt_started", "attempt_finished"]
