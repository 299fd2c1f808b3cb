"""agentloop installs as a package (issue 46, item 3): the wheel built from this checkout, installed in a
fresh virtual environment, trains the README's "your own agent" job from a folder outside the checkout.

The wheel must carry the three import packages (agentloop, trainer, integrations) and the ``agentloop``
command; the job's files are the README's own blocks (``# agent.py``, ``# tasks.jsonl``, ``# job.yaml``)
with the tiny test model and one short step substituted, so a README edit that breaks the path fails here.
Slow: the wheel's dependencies come from the package index (or pip's cache), then one step trains.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# README text -> what the test uses instead ({tiny} is the tiny model's folder); each must be in its block
TINY = {
    "path: smollm2-135m-instruct": "path: {tiny}",
    "rollout: {n: 4}": "rollout: {n: 2}",
    "total_training_steps: 20": "total_training_steps: 1, device: cpu, val_before_train: false",
    "max_response_length: 16": "max_response_length: 4",
}


def readme_block(lang: str, first_line: str) -> str:
    """The README's ```lang block whose first line is ``first_line``."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)
    found = [b for b in blocks if b.splitlines()[0] == first_line]
    assert len(found) == 1, f"README.md must have one ```{lang} block starting {first_line!r}"
    return found[0]


def test_the_readme_holds_the_own_agent_path_the_slow_test_runs() -> None:
    job = readme_block("yaml", "# job.yaml")
    missing = [text for text in TINY if text not in job]
    assert not missing, f"the install test substitutes {missing}, which README's job.yaml no longer has"
    assert "tasks.jsonl" in readme_block("bash", "# tasks.jsonl: one JSON task a line")
    assert "@al.rollout" in readme_block("python", "# agent.py")
    assert "pip install 'agentloop[" not in README  # no release on PyPI: a clone or a built wheel


def substituted_job(tiny: Path) -> str:
    """The README's job.yaml with the test's substitutions applied."""
    job = readme_block("yaml", "# job.yaml")
    for text, small in TINY.items():
        job = job.replace(text, small.replace("{tiny}", str(tiny)))
    return job


def test_the_substituted_job_is_a_valid_trainer_config(tmp_path: Path) -> None:
    """The slow test's job passes the trainer's checks (a too-small batch failed CI only after 10 minutes)."""
    import yaml

    from trainer import TrainerConfig

    doc = yaml.safe_load(substituted_job(tmp_path))
    config = TrainerConfig.from_dict({k: v for k, v in doc.items() if k not in ("agent", "train_data")})
    assert config.trainer.total_training_steps == 1


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    return out.stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(2400)
def test_the_built_wheel_trains_the_readme_job_in_a_fresh_venv(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dist, venv, project = tmp_path / "dist", tmp_path / "venv", tmp_path / "my_agent"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(dist), "-q"],
        tmp_path,
        900,
        env,
    )
    [wheel] = dist.glob("agentloop-*.whl")
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 300, env)
    py = str(venv / "bin" / "python")
    # torch: the CPU build this machine has on disk (another version downloads several GB)
    _run([py, "-m", "pip", "install", "-q", str(wheel), "torch==2.13.0"], tmp_path, 1500, env)

    project.mkdir()
    (project / "agent.py").write_text(readme_block("python", "# agent.py"))
    tasks = readme_block("bash", "# tasks.jsonl: one JSON task a line").splitlines()[1]
    assert tasks.startswith("python -c ") and tasks.endswith(" > tasks.jsonl")
    code = tasks.removeprefix("python -c ").removesuffix(" > tasks.jsonl").strip("'")
    (project / "tasks.jsonl").write_text(_run([py, "-c", code], project, 120, env))
    (project / "job.yaml").write_text(substituted_job(tiny_model_dir))

    where = _run(
        [py, "-c", "import agentloop, trainer, integrations; print(agentloop.__file__)"], project, 120, env
    )
    assert Path(where.strip()).is_relative_to(venv), where  # the installed package, not this checkout
    bin_dir = venv / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    out = _run([str(bin_dir / "agentloop"), "train", "job.yaml"], project, 900, env)
    run = project / "runs" / "job"
    assert f"run folder: {run}" in out, out
    assert (run / "final_model" / "model.safetensors").is_file() and (run / "metrics.jsonl").is_file()
