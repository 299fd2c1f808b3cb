"""A verifiers environment trained unchanged by ``agentloop train``, SmolLM2-135M on the CPU: does reward rise?

    make frameworks                  # .venv/frameworks/verifiers: verifiers 0.4.0 + agentloop
    OMP_NUM_THREADS=1 nice -n 19 .venv/frameworks/verifiers/bin/python benchmarks/verifiers_bench.py

Runs ``agentloop train examples/verifiers_envs/arith_job.yaml`` (the single-turn env vf_arith.py, its own
train split, validated greedily on its held-out test split before and after training) into a fresh run
folder, then reads the run's metrics.jsonl and writes ``benchmarks/results/verifiers_cpu.json``: the held-out
accuracy before/after, the training reward of the first/last steps (each also as the mean of 3 steps: one
step is 32 samples), every step's reward, the wall minutes, the command, the commit and the machine.
``--job`` and ``--set KEY=VALUE`` pass another job file or overrides to ``agentloop train``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "verifiers_envs" / "arith_job.yaml"
RESULT = ROOT / "benchmarks" / "results" / "verifiers_cpu.json"


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training steps' rows and the validation rows of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    vals = [r for r in rows if "val/reward_mean" in r]
    return steps, vals


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", type=Path, default=JOB)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args()
    agentloop = Path(sys.executable).with_name("agentloop")
    run_dir = Path(tempfile.mkdtemp(prefix="verifiers-bench-")) / "run"
    cmd = [str(agentloop), "train", str(args.job), "--set", f"trainer.default_local_dir={run_dir}"]
    for item in args.overrides:
        cmd += ["--set", item]
    shown = " ".join([f"{agentloop.relative_to(ROOT)}", "train", str(args.job.resolve().relative_to(ROOT))])
    shown += "".join(f" --set {o}" for o in args.overrides)
    from agentloop.commands.train import load_job

    job = load_job(args.job, args.overrides)  # the tasks it trains and validates on, for the record
    load_before = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        print(f"agentloop train exited {proc.returncode}; run folder {run_dir}", file=sys.stderr)
        return proc.returncode
    steps, vals = read_metrics(run_dir)
    rewards = [float(r["reward/mean"]) for r in steps]
    from benchmarks import result_file

    command = (
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} nice -n 19 {shown}  "
        "(run by .venv/frameworks/verifiers/bin/python benchmarks/verifiers_bench.py)"
    )
    head = result_file.header(
        "verifiers_bench",
        command=command,
        gpu=None,
        load_average_at_start=[round(x, 2) for x in load_before],
        nice=os.nice(0),
    )
    summary: dict[str, Any] = {
        "what": "a verifiers 0.4.0 environment (examples/verifiers_envs/vf_arith.py: 'What is a + b?', a, b "
        "in 0..20, after one worked turn '15 + 23 = 38'; its @vf.reward method: the reply's last number is the "
        "sum) trained unchanged by agentloop train, GRPO on SmolLM2-135M-Instruct on the CPU; validation greedy "
        "on the env's held-out split",
        "job_file": args.job.read_text(),
        "verifiers_version": version("verifiers"),
        "steps": len(steps),
        "wall_minutes": round(wall / 60, 1),
        "train_tasks": len(job.train),
        "val_tasks": len(job.val or []),
        "val_accuracy_before": vals[0]["val/reward_mean"] if vals else None,
        "val_accuracy_after": vals[-1]["val/reward_mean"] if len(vals) > 1 else None,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first3_mean": round(mean(rewards[:3]), 4) if len(rewards) >= 3 else None,
        "reward_last3_mean": round(mean(rewards[-3:]), 4) if len(rewards) >= 3 else None,
        "per_step": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in KEEP}
            for r in steps
        ],
        "validation": [
            {k: v for k, v in r.items() if k.startswith("val/") or k == "timing/val_s"} for r in vals
        ],
        "run_dir": str(run_dir),
    }
    document = result_file.result(head, summary)
    result_file.write(args.out, document)
    print(
        json.dumps(
            {k: v for k, v in document.items() if k not in ("per_step", "validation", "job_file")}, indent=2
        )
    )
    return 0


KEEP = ("step", "reward/mean", "actor/grad_norm", "timing/rollout_s", "timing/update_s", "timing/step_s")

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
