"""The CLI end to end: `train` a tiny model from a YAML config, `inspect` its run, `bench --results`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e  # every test runs the CLI in a subprocess

AGENT_MODULE = """
import openai
import agentloop as al

@al.rollout
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
    )
    return float(len(resp.choices[0].message.content or "") % 2)
"""


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, str]:
    """`agentloop train job/config.yaml` from the job's parent folder, with a flat job file whose
    paths (agent module, tasks, run folder) are relative to the file: the run folder and the console."""
    work = tmp_path_factory.mktemp("cli-train")
    job = work / "job"
    job.mkdir()
    (job / "cli_agent_mod.py").write_text(AGENT_MODULE)
    (job / "train.jsonl").write_text("\n".join(json.dumps({"q": f"question {i}"}) for i in range(8)))
    config = {
        "agent": "cli_agent_mod:agent",
        "train_data": "train.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 3},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "trainer": {"total_training_steps": 5, "device": "cpu", "default_local_dir": "run"},
    }
    (job / "config.yaml").write_text(yaml.safe_dump(config))
    out = _cli(
        "train",
        "job/config.yaml",
        "--set",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "--set",
        "trainer.total_training_steps=2",
        cwd=work,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 2 steps" in out.stdout
    match = re.search(r"run folder: (\S+)", out.stdout)
    assert match, out.stdout
    run_dir = Path(match.group(1))
    assert run_dir.is_relative_to(job / "run")  # default_local_dir: relative to the job file
    return run_dir, out.stdout + out.stderr


@pytest.fixture(scope="module")
def trained_run(trained: tuple[Path, str]) -> Path:
    return trained[0]


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_train_writes_the_run_folder(trained_run: Path) -> None:
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (
        json.loads((trained_run / "config.json").read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"]
        == 1e-4
    )


def test_train_console_has_no_per_rollout_lines(trained: tuple[Path, str]) -> None:
    console = trained[1]
    assert "attempt_started" not in console and "attempt_finished" not in console  # 8 rollouts ran
    assert "Traceback" not in console


def test_train_console_is_for_people_and_the_rest_is_in_log_txt(trained: tuple[Path, str]) -> None:
    """issue 46: piped output mixed JSON lines, progress bars and Ray's ``(TrainerWorker pid=...)``
    prefixes, a matplotlib UserWarning leaked, every run opened with a warning and said "trained 1 steps"."""
    run_dir, console = trained
    lines = console.splitlines()
    assert not [line for line in lines if line.lstrip().startswith("{")]  # no JSON unless asked
    assert "pid=" not in console and "Loading weights" not in console and "\r" not in console
    assert "Warning" not in console and "\x1b[" not in console  # no library warnings, no colors piped
    assert not [line for line in lines if "[warning" in line]  # a run that went well warns of nothing
    assert any("[info     ] writing run" in line for line in lines)
    assert "trained 2 steps; run folder:" in console
    log = (run_dir / "log.txt").read_text()
    events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
    assert {"runner_started", "step", "run finished"} <= set(events)  # every event, as JSON


def test_train_writes_report_and_curves_as_the_demo(trained_run: Path) -> None:
    """issue 46: `agentloop train` wrote no report.md/curves.png, though the demo did."""
    assert (trained_run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    report = (trained_run / "report.md").read_text()
    assert report.startswith(f"# Training run {trained_run}\n")
    assert "| training steps | 2 |" in report and "| train reward (mean), last step |" in report
    assert json.loads((trained_run / "summary.json").read_text())["steps"] == 2


FAILING_AGENT = """
import agentloop as al


def score(task, text):
    return float(text == task["answr"])


@al.rollout
async def agent(task, llm):
    return score(task, "4")
"""


def test_an_agent_error_is_shown_where_it_happened(tmp_path: Path, tiny_model_dir: Path) -> None:
    """issue 46: the console said ``8 x KeyError: 'answr'``, no file, no line. Now the first failure
    of each kind prints the user's frames, the summary names the line, and ``inspect --errors`` lists
    the attempts. Ray's worker output goes to the run's log.txt."""
    (tmp_path / "failing.py").write_text(FAILING_AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "2+2?"}\n{"prompt": "3+1?"}\n')
    doc = {
        "agent": "failing.py:agent",
        "train_data": "tasks.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}, "rollout": {"n": 2},
                              "actor": {"ppo_mini_batch_size": 2}},
        "trainer": {"total_training_steps": 1, "max_steps_without_signal": 1, "default_local_dir": "run",
                    "device": "cpu", "logger": ["jsonl"], "val_before_train": False},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    # the loading bars on: the trainer worker's goes to log.txt, not the console
    out = _cli("train", "job.yaml", cwd=tmp_path, env={"HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert out.returncode == 1, out.stderr[-3000:]
    err = out.stderr
    assert "pid=" not in err and "(TrainerWorker pid=" in (tmp_path / "run" / "log.txt").read_text()
    assert err.count("attempt_failed") == 1  # the first of its kind; 8 attempts failed
    (failed,) = [line for line in err.splitlines() if "attempt_failed" in line]
    assert "where='failing.py:6 in score'" in failed and "error=\"KeyError: 'answr'\"" in failed
    assert f'File "{tmp_path / "failing.py"}", line 11, in agent' in err  # the user's frames
    assert '    return float(text == task["answr"])' in err
    assert "frames of agentloop hidden]" in err and "agentloop/runner.py" not in err  # ours folded
    assert "8 x KeyError: 'answr' at failing.py:6 in score" in err.splitlines()[-1]
    assert f"`agentloop inspect {tmp_path / 'run'} --errors`" in err.splitlines()[-1]

    listed = _cli("inspect", "run", "--errors", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("8 failed attempts of 8 in run, 1 kind of error\n")
    assert listed.stdout.count("failing.py:6 in score") == 8


def test_inspect_prints_table_and_trajectory(trained_run: Path) -> None:
    out = _cli("inspect", str(trained_run), "--no-color", cwd=trained_run)
    assert out.returncode == 0, out.stderr
    assert "8 rollouts in" in out.stdout
    assert "succeeded" in out.stdout
    assert "[prompt]<|im_start|>" in out.stdout and "[model]" in out.stdout
    # the advantage the trainer gave the call, from its group (the other attempt at the task, same step)
    assert re.search(r"-> reward [01]\.0; advantage per call: [+-]\d\.\d{3}", out.stdout), out.stdout


def test_train_rejects_bad_config(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"agent": "x:y", "train_data": "t.jsonl", "oops": 1}))
    out = _cli("train", "bad.yaml", cwd=tmp_path)
    assert out.returncode == 2 and "unknown top-level keys ['oops']" in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    (tmp_path / "bad2.yaml").write_text(
        yaml.safe_dump({"agent": "no_such_module_xyz:agent", "train_data": "t.jsonl"})
    )
    out = _cli("train", "bad2.yaml", cwd=tmp_path)
    assert out.returncode == 2 and "no module named 'no_such_module_xyz'" in out.stderr


def test_train_bad_model_path_is_one_line(tmp_path: Path) -> None:
    """The old nested form (read with a note) and a model folder that does not exist: two lines, no traceback."""
    (tmp_path / "agent_for_bad_model.py").write_text(AGENT_MODULE)
    (tmp_path / "t.jsonl").write_text('{"q": "x"}\n')
    doc = {
        "agent": "agent_for_bad_model:agent",
        "train_data": "t.jsonl",
        "trainer": {"actor_rollout_ref": {"model": {"path": "./no-such-model"}}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    out = _cli("train", "job.yaml", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    note, error = out.stderr.splitlines()
    assert note.startswith(
        "agentloop train: note: job.yaml nests the config under 'trainer:', which is deprecated"
    )
    assert error == (
        f"agentloop train: error: actor_rollout_ref.model.path: model folder "
        f"'{tmp_path.resolve() / 'no-such-model'}' does not exist"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_with_one_line(tmp_path: Path, tiny_model_dir: Path, sig: signal.Signals) -> None:
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--store", str(tmp_path / "serve.db")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []  # the banner ends with "Ctrl-C to stop."
        while len(lines) < 20 and (not lines or lines[-1] not in ("Ctrl-C to stop.\n", "")):
            lines.append(proc.stdout.readline())
        assert lines[-1] == "Ctrl-C to stop.\n", lines
        assert any(line.startswith("  store (app sessions too):") for line in lines), lines
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-1] == f"agentloop serve: stopped by {sig.name}"
    assert "Traceback" not in err


def test_inspect_rejects_a_folder_without_store(tmp_path: Path) -> None:
    out = _cli("inspect", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "has no store.db" in out.stderr


def test_bench_results_table() -> None:
    out = _cli("bench", "--results", "--only", "engine_bench.py", cwd=Path.cwd())
    assert "engine vs HF generate (CPU)" in out.stdout
    assert out.returncode in (0, 1)  # 1 means a figure misses its target; the table is printed either way
