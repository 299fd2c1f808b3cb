"""examples/online_app: the gate's held-out questions never reach the app, the checker is strict, and
the app against ``agentloop serve --train`` (the tiny model) gets answers, posts rewards and sees
the server train and promote.

Real components: the app's own code, the CLI server in a subprocess, the tiny model (real tokenizer).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from examples.online_app import app
from examples.online_app.reward import app_reward, score
from trainer.demos.arithmetic import make_datasets

HERE = Path(app.__file__).parent


def test_the_gate_questions_are_held_out_and_the_committed_file_is_current(tmp_path: Path) -> None:
    n = app.write_eval(tmp_path / "eval.jsonl", 60, 0)
    written = (tmp_path / "eval.jsonl").read_text()
    assert n == 60 and written == (HERE / "eval.jsonl").read_text()  # the file online.yaml names
    train, _ = make_datasets(20, 60, 0)
    asked = {t["question"] for t in train}
    gate = [json.loads(line) for line in written.splitlines()]
    assert not asked & {task["messages"][-1]["content"] for task in gate}


def test_the_checker_is_strict() -> None:
    task = {"answer": 7}
    assert score(task, "3 + 4 = 7\n<answer>7</answer>") == 1.0
    assert score(task, "<answer>8</answer> <answer>7</answer>") == 0.0  # the first tag counts
    assert score(task, "7") == 0.0 and app_reward(task, "7") == 0.0
    assert app_reward(task, "<answer>9</answer>") == 0.1  # the app's format bonus, never the gate's


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_the_app_against_serve_train(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the server's admin key, which the app reads the promotions with
    monkeypatch.setenv("AGENTLOOP_ADMIN_KEY", "online-app-admin-key")
    for name in ("online.yaml", "eval.jsonl", "reward.py"):
        shutil.copy(HERE / name, tmp_path / name)
    config = (
        (tmp_path / "online.yaml").read_text().replace("sessions_per_update: 16", "sessions_per_update: 4")
    )
    (tmp_path / "online.yaml").write_text(config)
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", "--model", str(tiny_model_dir), "--port", "0"]
    cmd += [
        "--store",
        str(tmp_path / "s.db"),
        "--train",
        str(tmp_path / "online.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=HERE.parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while len(lines) < 20 and (not lines or lines[-1] not in ("Ctrl-C to stop.\n", "")):
            lines.append(proc.stdout.readline())
        (base,) = [line.split()[-1] for line in lines if "OpenAI base URL" in line]
        args = app.build_parser().parse_args(
            ["--url", base.removesuffix("/v1"), "--minutes", "0.4", "--users", "4", "--delay-s", "0.2",
             "--window-min", "0.1", "--model", tiny_model_dir.name]
        )  # fmt: skip
        summary = anyio.run(app.main, args)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and summary["updates"] == 0:
            time.sleep(1)
            summary["updates"] = anyio.run(app.read_versions, args)["updates"]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert summary["requests_served"] > 0 and summary["request_errors"] == 0
    assert summary["latency_p50_s"] <= summary["latency_p99_s"]
    assert summary["updates"] >= 1
