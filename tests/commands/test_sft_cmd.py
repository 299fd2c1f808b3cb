"""``agentloop sft STORE --config X.yaml``: one-line errors for bad input, and a run on the tiny model
(in-process through ``agentloop.cli.main``; the store is written through the Store API)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import yaml

from agentloop.cli import main
from tests.trainer.sft.test_sft import _hand_store


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _config(folder: Path, model: Path, **sections: dict) -> Path:
    """A config file: the trainer sections (paths relative to it) and an sft section."""
    doc = {
        "agent": "agent.py:agent",  # an `agentloop train` job file works as it is: its job keys are not used
        "actor_rollout_ref": {"model": {"path": str(model)}, "actor": {"optim": {"lr": 1e-3}}},
        "data": {"train_batch_size": 2},
        "trainer": {"total_epochs": 1, "device": "cpu", "logger": ["jsonl"], "default_local_dir": "run"},
        **sections,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sft.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_help_shows_the_config_and_the_filters(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    for text in (
        "--min-reward",
        "--mode",
        "--include-failed",
        "--val-fraction",
        "sft: {min_reward",
        "final_model",
    ):
        assert text in out, text


def test_a_missing_store_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sft", str(tmp_path / "runs" / "nope")]) == 2
    line = _err_line(capsys)
    assert line.startswith("agentloop sft: error: ") and "does not exist" in line


def test_a_file_that_is_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.db").write_text("hello")
    assert main(["sft", str(tmp_path / "notes.db")]) == 2
    assert "cannot be read as an agentloop store" in _err_line(capsys)


def test_no_rollout_passes_the_filter(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_hand_store, tmp_path / "store.db", 3, 0.5)
    config = _config(tmp_path / "cfg", tiny_model_dir)
    assert main(["sft", str(tmp_path), "--config", str(config), "--min-reward", "1.0"]) == 2
    line = _err_line(capsys)
    assert "no attempt passes the filter" in line and "3 rollouts (3 train/succeeded)" in line
    assert "0.5 x 3" in line and "lower --min-reward" in line


def test_bad_keys_and_flags(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_hand_store, tmp_path / "store.db", 3)
    config = _config(tmp_path / "cfg", tiny_model_dir, sft={"min_rewrd": 1.0})
    assert main(["sft", str(tmp_path), "--config", str(config)]) == 2
    assert "unknown key 'sft.min_rewrd'; did you mean 'min_reward'?" in _err_line(capsys)
    config = _config(tmp_path / "cfg", tiny_model_dir)
    assert main(["sft", str(tmp_path), "--config", str(config), "--set", "trainer.total_epoch=2"]) == 2
    assert "unknown key 'trainer.total_epoch'" in _err_line(capsys)
    assert main(["sft", str(tmp_path), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file" in _err_line(capsys)
    assert main(["sft", str(tmp_path), "--any-reward", "--min-reward", "1"]) == 2
    assert "exclude each other" in _err_line(capsys)


def test_a_run_writes_the_model_to_start_rl_from(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_hand_store, tmp_path / "store.db", 6)
    config = _config(tmp_path / "cfg", tiny_model_dir)
    argv = ["sft", str(tmp_path / "store.db"), "--config", str(config), "--val-fraction", "0.2"]
    assert main([*argv, "--set", "trainer.save_freq=1"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "cfg" / "run"  # default_local_dir is relative to the config file
    assert f"run folder: {run}" in out and "trained 2 steps on 4 attempts (2 held out)" in out
    assert (run / "final_model" / "model.safetensors").is_file() and (run / "loss_curve.png").is_file()
    config_json = json.loads((run / "config.json").read_text())
    assert config_json["sft"]["val_fraction"] == 0.2 and config_json["trainer"]["save_freq"] == 1

    from trainer import TrainerConfig

    warm = TrainerConfig.from_dict({"actor_rollout_ref": {"model": {"path": str(run / "final_model")}}})
    from agentloop.engine.models import resolve_model

    assert resolve_model(warm.actor_rollout_ref.model.path) == run / "final_model"  # RL starts from it


# ---------------------------------------------------------------- the docs' sequence

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "your-agent.md"  # its "Warm-starting with SFT" section
_TINY_DEMO = "--steps 1 --batch-size 2 --n 2 --train-size 4 --val-size 2 --max-tokens 16"
# The page's text -> what this test runs instead ({tiny}: the tiny model's folder); each must be in the block
SFT_TINY = {
    "--task tools --name tools-grpo": f"--task tools --name tools-grpo --model {{tiny}} {_TINY_DEMO}",
    "--min-reward 1.0": "--any-reward --set data.train_batch_size=2",  # a random model earns no reward
    "--name tools-rl": f"--name tools-rl {_TINY_DEMO}",
}


def readme_sft_commands() -> list[str]:
    """The commands of docs/your-agent.md's ```bash block under "Warm-starting with SFT" (continuations joined,
    comment lines left out)."""
    import re

    section = PAGE.read_text().split("## Warm-starting with SFT", 1)[1]
    [block] = re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)[:1]
    lines = block.replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow  # three commands as subprocesses: two tiny tools-demo runs (Ray) and an SFT run
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_readme_sft_sequence_runs_as_written(tmp_path: Path, tiny_model_dir: Path) -> None:
    import os
    import shlex
    import subprocess
    import sys

    commands = readme_sft_commands()
    assert [c.split()[:2] for c in commands] == [
        ["agentloop", "demo"],
        ["agentloop", "sft"],
        ["agentloop", "demo"],
    ]
    text = "\n".join(commands)
    missing = [t for t in SFT_TINY if t not in text]
    assert not missing, f"the docs' SFT block no longer holds {missing}: update SFT_TINY"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in commands:
        for old, new in SFT_TINY.items():
            command = command.replace(old, new.replace("{tiny}", str(tiny_model_dir)))
        argv = [str(Path(sys.executable).with_name("agentloop")), *shlex.split(command, comments=True)[1:]]
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{command}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    runs = tmp_path / "runs"
    assert (runs / "tools-grpo" / "store.db").is_file()
    assert (runs / "tools-sft" / "final_model" / "model.safetensors").is_file()
    sft_metrics = [json.loads(x) for x in (runs / "tools-sft" / "metrics.jsonl").read_text().splitlines()]
    assert any("sft/loss" in row for row in sft_metrics)
    rl_config = json.loads((runs / "tools-rl" / "config.json").read_text())
    assert rl_config["actor_rollout_ref"]["model"]["path"] == "runs/tools-sft/final_model"  # RL from SFT
    assert (runs / "tools-rl" / "metrics.jsonl").is_file()
