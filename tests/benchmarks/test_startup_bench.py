"""benchmarks/startup_bench.py (issue 46 item 8): the CPU seconds of a process tree, by process, and a whole
run with the tiny model (slow) that prints every phase up to the first rollout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmarks import BENCHMARKS, load_benchmark


def test_tree_cpu_counts_the_children_by_name() -> None:
    bench = load_benchmark("startup_bench")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 60
        while bench.tree_cpu_s(by_process=True).get("python", 0) < 0.3:  # the child's cmdline has no .py
            assert time.monotonic() < deadline, bench.tree_cpu_s(by_process=True)
            time.sleep(0.1)
        names = bench.tree_cpu_s(by_process=True)
        assert names["driver"] > 0 and bench.tree_cpu_s() >= names["driver"] + names["python"] - 0.02
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_run_reports_every_phase_up_to_the_first_rollout(tiny_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "startup_bench.py"), "--model", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["rc"] == 0 and result["first_rollout_s"] < result["first_response_s"] < result["step_s"]
    assert {"ray.init", "the proxy to start"} <= set(result["phases"])
    assert any(k.startswith("the trainer worker to load") for k in result["phases"])
    assert result["cpu_by_process"]["until_first_rollout"]["driver"] > 0
    # on a CPU the worker starts once the engine is up, and the first rollout does not wait for it
    [engine] = [v for k, v in result["phases"].items() if k.startswith("the inference engine to load")]
    [worker] = [v for k, v in result["phases"].items() if k.startswith("the trainer worker to load")]
    assert worker[0] >= engine[1] and result["first_rollout_s"] < worker[1]
    assert result["machine"]["cores"] >= 1 and len(result["machine"]["loadavg_at_start"]) == 3
