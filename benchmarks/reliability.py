"""Reliability figures: faults injected and survived, fuzz inputs tried, 5xx count, lost rollouts, load,
attacks held.

Runs tests/reliability (fault injection with real processes and signals, hypothesis fuzzing, security,
attacks on the servers: one row {"name", "tried", "held", "lost"} each) with a report file, then the long
load run (1000 concurrent agents x 5 turns through the proxy with an
instant engine and the SQLite store), and writes benchmarks/results/reliability.json.

    python benchmarks/reliability.py [--agents 1000] [--turns 5] [--out benchmarks/results/reliability.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import result_file  # noqa: E402
from tests.reliability.load import run_load  # noqa: E402
from tests.reliability.report import ENV  # noqa: E402

# one row per attack: the worst answer a legitimate client got during it and the server's memory growth
ATTACK_COLUMNS = ("name", "tried", "held", "lost", "worst_legit_ms", "memory_growth_mb")


def run_tests(report: Path) -> tuple[int, list[dict[str, Any]]]:
    env = {**os.environ, ENV: str(report)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stdout[-2000:])
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return proc.returncode, rows


async def load(agents: int, turns: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny"))
        return await run_load(tokenizer, Path(tmp) / "load.db", agents=agents, turns=turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reliability.json")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rc, rows = run_tests(Path(tmp) / "report.jsonl")
    faults = [r for r in rows if r["kind"] == "fault"]
    fuzz = [r for r in rows if r["kind"] == "fuzz"]
    attacks = [r for r in rows if r["kind"] == "attack"]
    big = anyio.run(load, args.agents, args.turns)
    small = next((r for r in rows if r["kind"] == "load"), None)
    faults.append({"name": "trainer SIGKILLed after a checkpoint and resumed (same next step)",
                   "survived": None, "covered_by": "tests/trainer/fit/test_resume.py"})  # fmt: skip
    head = result_file.header("reliability", gpu=None, python=platform.python_version())
    report = {
        "what": "fault injection, hostile-input fuzzing, security, load",
        "load_average_at_start": load_at_start,
        "tests_passed": rc == 0,
        "faults_injected": len(faults) - 1,
        "faults_survived": sum(1 for f in faults if f.get("survived")),
        "faults": [{k: v for k, v in f.items() if k != "kind"} for f in faults],
        "inputs_tried": sum(f["examples"] for f in fuzz),
        "fuzz": [{k: v for k, v in f.items() if k != "kind"} for f in fuzz],
        "server_5xx": sum(f["server_errors"] for f in fuzz),
        "lost_rollouts": sum(f.get("lost_rollouts", 0) for f in faults) + big["lost_rollouts"]
        + (small["lost_rollouts"] if small else 0),
        "attacks_held": sum(1 for a in attacks if a["held"] and a["lost"] == 0),
        "attacks": [{k: a[k] for k in ATTACK_COLUMNS if k in a} for a in attacks],
        "attacks_measured": [a["detail"] for a in attacks],
        "load": big,
        "load_in_tests": {k: v for k, v in small.items() if k != "kind"} if small else None,
    }  # fmt: skip
    print(json.dumps(result_file.result(head, report), indent=2))
    result_file.write(args.out, result_file.result(head, report))
    if rc != 0 or report["server_5xx"] or report["lost_rollouts"] or report["attacks_held"] < len(attacks):
        sys.exit(1)


if __name__ == "__main__":
    main()
