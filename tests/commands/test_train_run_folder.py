"""``agentloop train``'s run folder (issue 46, item 2), the command in a subprocess as a user runs it: the
folder is ``runs/<job name>/`` beside the job file whatever the working folder; a second run from another
folder returns the finished run; a changed key stops with the key named (old -> new) and both ways on;
``--resume-with-changes`` continues the run with a new step count and learning rate; ``--more-steps N``
trains N more; a key a resume may not change is refused by name. Tiny model, Ray, the real proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # three short fits in subprocesses: ~1-2 min on 2 cores

AGENT = """
import agentloop as al
import openai

@al.rollout
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    return ((out.model_extra or {})["token_ids"][0] % 97) / 97
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_run_folder_follows_the_job_file_and_changes_are_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "agent.py").write_text(AGENT)
    (project / "tasks.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(4))
    )
    job = {
        "agent": "agent.py:agent",
        "train_data": "tasks.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2}},
        },
        "trainer": {"total_training_steps": 1, "device": "cpu", "logger": ["jsonl"]},
    }
    (project / "qa.yaml").write_text(yaml.safe_dump(job))
    run = project / "runs" / "qa"

    first = _cli("train", "../project/qa.yaml", cwd=elsewhere)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"run folder: {run}" in first.stdout and not (elsewhere / "runs").exists()
    assert (run / "final_model").is_dir() and (run / "checkpoints" / "global_step_1").is_dir()  # save_last

    again = _cli("train", "project/qa.yaml", cwd=tmp_path)  # another working folder: the same run
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run folder: {run}" in again.stdout and _steps(run) == [1]

    changed = ["--set", "trainer.total_training_steps=2", "--set", "actor_rollout_ref.actor.optim.lr=0.05"]
    stopped = _cli("train", "project/qa.yaml", *changed, cwd=tmp_path)
    assert stopped.returncode == 2 and stopped.stdout == ""
    assert stopped.stderr.splitlines()[-1] == (
        f"agentloop train: error: {run} holds a run of other settings: "
        "actor_rollout_ref.actor.optim.lr: 0.01 -> 0.05; trainer.total_training_steps: 1 -> 2; continue "
        "that run with these changes with --resume-with-changes, or start a new run in "
        f"{run.with_name('qa-2')} with --fresh"
    )

    resumed = _cli("train", "project/qa.yaml", *changed, "--resume-with-changes", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing the run in {run} from step 1 with actor_rollout_ref" in resumed.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/lr"] == pytest.approx(1e-2) and rows[1]["actor/lr"] == pytest.approx(0.05)
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "finished" and record["step"] == 2
    assert record["continued"][0]["step"] == 1 and len(record["continued"][0]["changes"]) == 2

    more = _cli("train", "project/qa.yaml", "--more-steps", "1", cwd=tmp_path)  # the file's lr again
    assert more.returncode == 0, more.stderr[-3000:]
    assert _steps(run) == [1, 2, 3] and not run.with_name("qa-2").exists()
    assert "trainer.total_training_steps: 2 -> 3" in more.stderr

    refused = _cli(
        "train",
        "project/qa.yaml",
        "--set",
        "data.max_response_length=3",
        "--resume-with-changes",
        cwd=tmp_path,
    )
    assert refused.returncode == 2
    line = refused.stderr.splitlines()[-1]
    assert line.startswith(
        f"agentloop train: error: cannot continue the run in {run} with data.max_response_length"
    )
    assert line.endswith(f"start a new run in {run.with_name('qa-2')} with --fresh")

    (project / "new.yaml").write_text(yaml.safe_dump(job))  # another job file: its own folder, no run yet
    nothing = _cli("train", "project/new.yaml", "--more-steps", "2", cwd=tmp_path)
    assert nothing.returncode == 2 and nothing.stderr.splitlines()[-1] == (
        f"agentloop train: error: --more-steps: {project / 'runs' / 'new'} holds no run to continue; "
        "train it first: agentloop train project/new.yaml"
    )
