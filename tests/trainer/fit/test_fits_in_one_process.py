"""Several fits in one process, as a notebook or a sweep runs them: Ray starts once, on agentloop's Ray
thread (trainer/distributed/placement.py ``on_ray_thread``), and serves every later fit, also after the user
shut it down between fits; a script that imported Ray before the first fit trains too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, sys, threading
{early_import}
from pathlib import Path
from tests.trainer.fit.test_fit import _config, _tasks, allowed_tokens_agent
from trainer import Trainer

folder, model = Path(sys.argv[1]), sys.argv[2]
steps = []
for i in range({fits}):
    cfg = _config(folder / f"fit{{i}}", Path(model))
    cfg["trainer"]["total_training_steps"] = 1
    cfg["actor_rollout_ref"]["rollout"]["n"] = 2
    steps.append(Trainer(cfg).fit(allowed_tokens_agent, _tasks(8)).steps)
    if i == 0 and {fits} > 2:
        import ray
        ray.shutdown()
threads = sum(t.name == "agentloop-ray" for t in threading.enumerate())
print(json.dumps({{"steps": steps, "ray_threads": threads}}))
"""


def _run(tmp_path: Path, model: Path, fits: int, early_import: str) -> dict:
    script = tmp_path / "fits.py"
    script.write_text(SCRIPT.format(fits=fits, early_import=early_import))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_AUTH_MODE", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.slow  # three fits with Ray in a subprocess: about a minute on 2 cores
def test_three_fits_share_one_ray_also_after_a_shutdown(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = _run(tmp_path, tiny_model_dir, fits=3, early_import="")
    assert out == {"steps": [1, 1, 1], "ray_threads": 1}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_that_imported_ray_first_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Ray reads its token-auth mode when imported: the trainer leaves RAY_AUTH_MODE alone then (set
    afterwards, Ray's GCS wanted a token its client did not send: "Failed to start GCS")."""
    assert _run(tmp_path, tiny_model_dir, fits=1, early_import="import ray") == {
        "steps": [1],
        "ray_threads": 1,
    }
