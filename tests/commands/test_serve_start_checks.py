"""``agentloop serve`` refuses at once what would fail after the model loads (issue 46): a port already
taken is one line before any model is read, and a run folder serves its ``final_model/`` (or says the
run has not finished) instead of a tokenizer error.

Real components: the ``agentloop`` command in a subprocess; a real listening socket holds the port.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.commands.serve import model_of_run_folder

pytestmark = pytest.mark.e2e  # `agentloop serve` in a subprocess


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "agentloop.cli", "serve", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_taken_port_is_one_line_before_the_model_is_read(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model does not exist: the port error comes first, so nothing was loaded
        out = _serve("--model", str(tmp_path / "no-such-model"), "--port", str(port), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"agentloop serve: error: port {port} on 127.0.0.1 is already in use (another agentloop serve?): "
        "stop what listens there or pass --port N (--port 0 picks a free one)"
    ]
    assert not (tmp_path / "agentloop-serve.db").exists()


def _run_folder(root: Path) -> Path:
    run = root / "runs" / "job"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"actor_rollout_ref": {"model": {"path": "x"}}}))
    (run / "run.json").write_text("{}")
    return run


def test_an_unfinished_run_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    out = _serve("--model", str(run), "--port", "0", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"agentloop serve: error: --model: {str(run)!r} is a training run folder without final_model/ (the "
        "run has not finished): finish it (agentloop train JOB.yaml) or pass a model folder"
    ]


def test_a_run_folder_serves_its_final_model(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path)
    shutil.copytree(tiny_model_dir, run / "final_model")
    assert model_of_run_folder(str(run)) == run / "final_model"
    assert (
        f"{run} is a run folder; serving its trained model {run / 'final_model'}" in capsys.readouterr().err
    )
    assert model_of_run_folder(str(tiny_model_dir)) == str(tiny_model_dir)  # a model folder: itself
    assert model_of_run_folder("smollm2-135m-instruct") == "smollm2-135m-instruct"
