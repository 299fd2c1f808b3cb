"""tinker-cookbook's own loops (supervised and RL) against `agentloop tinker` on SmolLM2, unchanged but for
the base URL: a short run of benchmarks/tinker_cpu.py in the cookbook's virtualenv (make frameworks)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".venv" / "frameworks" / "tinker" / "bin" / "python"


def test_cookbook_supervised_and_rl_loops_run_against_the_server(tmp_path: Path) -> None:
    if not SIDE_PYTHON.exists():
        pytest.skip(f"{SIDE_PYTHON} does not exist: `make frameworks` builds the tinker-cookbook virtualenv")
    probe = subprocess.run([str(SIDE_PYTHON), "-c", "import tinker_cookbook"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(
            f"tinker-cookbook does not import in {SIDE_PYTHON}: {probe.stderr.strip().splitlines()[-1:]}"
        )
    out = tmp_path / "tinker_cpu.json"
    args = ["--sl-steps", "3", "--sl-batch", "4", "--sl-lr", "1e-3", "--rl-steps", "2", "--rl-groups", "2"]
    args += ["--rl-group-size", "2", "--out", str(out)]
    run = subprocess.run(
        [str(SIDE_PYTHON), str(ROOT / "benchmarks" / "tinker_cpu.py"), *args],
        capture_output=True, text=True, timeout=1200, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    result = json.loads(out.read_text())
    for key in (
        "sl_loss_first",
        "sl_loss_last",
        "rl_reward_first",
        "rl_reward_last",
        "wall_minutes",
        "sdk_version",
    ):
        assert key in result, key
    assert result["sdk_version"] == "0.38.0"
    curve = result["sl"]["curve"]
    assert len(curve) == 3 and curve[-1] < curve[0], curve  # the supervised loss falls
    assert len(result["rl"]["curve"]) == 2
    assert all(-0.11 <= r <= 1.0 for r in result["rl"]["curve"]), result["rl"]
